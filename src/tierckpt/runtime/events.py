"""The append-only JSONL event log: the only source of measured C, W and R.

Each line is one JSON object with at least ``event`` (a kind below), ``t`` (wall-clock
seconds since the epoch), ``rank`` and ``pid``; ``step`` where one applies. Lines are written
with a single ``write()`` on an ``O_APPEND`` descriptor so concurrent ranks never interleave
inside a line. Readers skip a torn last line (a crash mid-write) instead of failing.

Kinds and their fields (seconds are floats, bytes ints):

==================  =============================================================
save_staged         seconds (blocking time C), bytes (staged on this rank)
save_durable        seconds (stage end → this rank's files fsync'd), bytes, tier
save_committed      seconds (save() entry → COMPLETE), bytes (all ranks), write_seconds (W),
                    tier (tier1, or tier0 for a save kept in RAM only)
save_failed         error
overlap             seconds (time save() waited for the previous save)
save_cost           seconds (C + slower steps while the save ran; see runtime.save_cost),
                    window_s, steps, step_s (idle seconds per step)
restore_started     —
checkpoint_chosen   step, source, skipped (list of {step, reason})
checkpoint_skipped  step, reason, moved_to
metadata_fallback   step, reason (this rank's own ``__<rank>.metadata`` failed its check: the
                    reads were planned from the global ``.metadata``, which holds the same)
restore_done        seconds, bytes, source, bytes_by_source, world_size, saved_world_size
state_loaded        seconds
process_start       restart_count (torchrun's), process_started_at, scheduler (under Slurm or
                    Kubernetes: name, job_id, restarts — the requeue or JobSet restart this
                    run is —, partition, node or pod; runtime.scheduler)
pg_ready            seconds
first_step          seconds_since_process_start
failure_detected    how (watchdog | kill | ...), detail
hang_detected       seconds_without_step
upload_started      bytes
upload_verified     seconds, bytes
upload_failed       error
tier2_unavailable   reason (tier 2 could not be listed or read in time; tier 1 used; or,
                    with retry_in_s, waited_s, outage_wait_s: it holds the only copy and
                    the start waits for it)
tier2_unhealthy     error, due (steps waiting for upload), alive, restarts
uploader_restarted  restarts, exit_code, reason
upload_due          step, upload_every (this commit is the Nth since the last one marked
                    for tier 2: the uploader copies it)
final_save          step, last_saved (a clean close() saved the loop's last step: it ran
                    past the newest save)
upload_skipped      step, reason (released from tier 1 before its upload: backlog full)
upload_drained      seconds, left (steps close() left on tier 1 only)
progress            step (at most every PROGRESS_EVERY_S: what goodput's lost work needs)
interval_decided    interval_s, M_s, step_s, next_step, inputs (C, W, R, node_mtbf, nodes,
                    failures, exposure_s and each one's source)
tier0_saved         step, bytes (this rank's), seconds (stage end → committed in RAM)
tier0_replicated    step, bytes (the partner's files received), seconds
tier0_replication_failed  step, error (the save stands; the replica is missing)
tier0_disabled      reason (tier0=Tier0() and it does not fit; the job runs without it)
launcher_lost       parent_pid (the torchrun agent died; this worker stops itself)
preempt_notice      source, received_unix, deadline_unix, detail (a termination notice this
                    rank received itself, or first saw through the job's store: source rank:<r>),
                    step (the newest step this rank's loop had reached a check at then; -1: none)
preempt_stop        step (the step every rank agreed to stop after), source, notice_s
                    (this rank's notice → the agreed step's end), deadline_unix
preempt_saved       step, reached (tiers that hold the emergency save, fastest first),
                    abandoned ({tier: why} for the tiers the grace did not allow), seconds
                    (notice → durable on the last reached tier), remaining_s (before deadline)
preempt_exit        code (the process exits with it after close(): preempted, checkpoint saved)
slurm_requeue       step, job_id, requeued (rank 0 ran ``scontrol requeue`` and it succeeded),
                    why (under Slurm, after an emergency save: preempt.requeue)
manager_closed      clean (a close that drained: no error left the loop), stopped (the loop
                    left on a notice), step (the newest committed step)
heal_begin          generation (the one that failed), error (what the survivor caught)
heal_done           generation (the one joined), dead (ranks replaced), step (restored),
                    source, seconds (heal_begin → state loaded), leave_s, wait_s, form_s,
                    open_s, restore_s (its parts: the failed generation let go, the
                    launcher's next one awaited, the group formed, the manager reopened, the
                    state loaded)
heal_failed         generation, error, phase (the survivor exits; the launcher restarts all)
==================  =============================================================
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SAVE_STAGED = "save_staged"
SAVE_DURABLE = "save_durable"
SAVE_COMMITTED = "save_committed"
SAVE_FAILED = "save_failed"
OVERLAP = "overlap"
SAVE_COST = "save_cost"
RESTORE_STARTED = "restore_started"
CHECKPOINT_CHOSEN = "checkpoint_chosen"
CHECKPOINT_SKIPPED = "checkpoint_skipped"
METADATA_FALLBACK = "metadata_fallback"
RESTORE_DONE = "restore_done"
STATE_LOADED = "state_loaded"
PROCESS_START = "process_start"
PG_READY = "pg_ready"
FIRST_STEP = "first_step"
FAILURE_DETECTED = "failure_detected"
HANG_DETECTED = "hang_detected"
UPLOAD_STARTED = "upload_started"
UPLOAD_VERIFIED = "upload_verified"
UPLOAD_FAILED = "upload_failed"
TIER2_UNAVAILABLE = "tier2_unavailable"
TIER2_UNHEALTHY = "tier2_unhealthy"
UPLOADER_RESTARTED = "uploader_restarted"
UPLOAD_SKIPPED = "upload_skipped"
UPLOAD_DUE = "upload_due"
FINAL_SAVE = "final_save"
UPLOAD_DRAINED = "upload_drained"
INTERVAL_DECIDED = "interval_decided"
PROGRESS = "progress"
LAUNCHER_LOST = "launcher_lost"
TIER0_SAVED = "tier0_saved"
TIER0_REPLICATED = "tier0_replicated"
TIER0_REPLICATION_FAILED = "tier0_replication_failed"
TIER0_DISABLED = "tier0_disabled"
PREEMPT_NOTICE = "preempt_notice"
PREEMPT_STOP = "preempt_stop"
PREEMPT_SAVED = "preempt_saved"
PREEMPT_EXIT = "preempt_exit"
SLURM_REQUEUE = "slurm_requeue"
MANAGER_CLOSED = "manager_closed"
HEAL_BEGIN = "heal_begin"
HEAL_DONE = "heal_done"
HEAL_FAILED = "heal_failed"


MAX_PENDING = 10_000
"""Events kept in memory while the log cannot be written (e.g. a full disk); beyond this
the oldest are dropped (counted in ``EventLog.dropped``)."""


PROGRESS_EVERY_S = 10.0


class ProgressMarks:
    """Emits ``progress`` (the step just completed) at most every ``every_s`` seconds: the
    cheap record of how far a process got, for the goodput report's lost work."""

    def __init__(self, log: EventLog, every_s: float | None = None) -> None:
        if every_s is None:  # TIERCKPT_PROGRESS_EVERY_S: e.g. 0 in tests, every step
            every_s = float(os.environ.get("TIERCKPT_PROGRESS_EVERY_S", PROGRESS_EVERY_S))
        self.log, self.every_s = log, every_s
        self._next = 0.0

    def step(self, step: int) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.every_s
            self.log.emit(PROGRESS, step=step)


class EventLog:
    """Appends events for one process to ``path`` (created with mode 0o640 if missing).

    ``emit`` never raises on I/O errors after construction: losing a measurement must not
    kill training. A line that cannot be written (ENOSPC, EIO) is kept in memory and written,
    in order, before the next event once the file accepts writes again (or at ``close``), so
    a ``save_failed`` on a full disk is not lost. It returns the record it wrote or kept.
    """

    def __init__(self, path: str | os.PathLike[str], rank: int = 0, mode: int = 0o640) -> None:
        self.path = Path(path)
        self.rank = rank
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, mode)
        self.pending: collections.deque[bytes] = collections.deque(maxlen=MAX_PENDING)
        self.dropped = 0
        self._lock = threading.Lock()  # the saver thread emits too
        self._torn = False  # the last write was cut short (ENOSPC): end the fragment first

    def emit(self, event: str, step: int | None = None, **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {"event": event, "t": time.time(), "rank": self.rank,
                                  "pid": os.getpid()}
        if step is not None:
            record["step"] = step
        record.update(fields)
        line = (json.dumps(record, default=str) + "\n").encode("utf-8")
        with self._lock:
            if len(self.pending) == MAX_PENDING:
                self.dropped += 1
            self.pending.append(line)
            self._flush()
        return record

    def flush(self) -> bool:
        """Write the kept lines, oldest first; True when none is left."""
        with self._lock:
            return self._flush()

    def _flush(self) -> bool:
        try:
            if self._torn and self._fd >= 0:  # end a fragment a full disk cut short, so
                self._torn = os.write(self._fd, b"\n") != 1  # it stays one bad line alone
            while self.pending and self._fd >= 0 and not self._torn:
                line = self.pending[0]
                if os.write(self._fd, line) < len(line):  # one write per line; a short one
                    self._torn = True  # is a fragment readers skip: end it, write it again
                    return False
                self.pending.popleft()
        except OSError:
            return False
        return not self.pending

    def close(self) -> None:
        if self._fd >= 0:
            self.flush()
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All well-formed events in ``path`` in file order (a torn or garbled line is skipped)."""
    return list(iter_events(path))


def iter_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    with open(path, "rb") as f:
        for raw in f:
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if isinstance(rec, dict) and "event" in rec:
                yield rec
