"""The job's side of its uploader: start it, watch it, restart it when it dies, drain it when
the job ends — and say loudly, in the training process, when tier 2 is failing.

The uploader is a separate process whose errors land in its upload records
(``upload-state/step-*.json``) and its log; nobody reads those during a two-week job. The
:class:`UploaderSupervisor` does, each time the manager saves (:meth:`check`): a dead child
is restarted with exponential back-off (``uploader_restarted``), and a tier 2 whose newest
upload failed — or whose uploader keeps dying — is reported as a ``tier2_unhealthy`` event
and a ``tierckpt`` logger warning, at most once per ``warn_every_s`` for the same reason.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from tierckpt.policy import retention
from tierckpt.runtime import events
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.uploads import UPLOAD_LOG
from tierckpt.tier2.uploader.config import UploaderConfig
from tierckpt.tier2.uploader.process import UploaderProcess

_log = logging.getLogger("tierckpt")
FIRST_RESTART_S = 5.0
MAX_RESTART_S = 300.0
WARN_EVERY_S = 600.0
STOP_GRACE_S = 5.0
"""How long a close that chose not to wait gives the uploader to exit on SIGINT before
SIGKILL (it may be stuck in a call to a server that never answers)."""


@dataclasses.dataclass(frozen=True)
class Health:
    """What the supervisor knows about its uploader now. ``error`` is why tier 2 is not
    healthy (the newest upload failed, or the uploader died), None when it is."""

    alive: bool
    restarts: int
    last_success_unix: float | None
    error: str | None
    due: tuple[int, ...]

    @property
    def healthy(self) -> bool:
        return self.error is None


class UploaderSupervisor:
    """Owns one :class:`UploaderProcess` for a tier-1 root. Not thread-safe: the manager
    calls it from the training thread. ``clock`` is injectable for tests of the back-off."""

    def __init__(self, config: UploaderConfig, *, log: events.EventLog,
                 warn_every_s: float = WARN_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.log, self.warn_every_s, self._clock = config, log, warn_every_s, clock
        self.local = Tier1Catalog(config.tier1)
        self.restarts = 0
        self._proc: UploaderProcess | None = None
        self._backoff = FIRST_RESTART_S
        self._restart_at = 0.0
        self._restarted_unix = 0.0  # wall clock: compared with upload records
        self._died: str | None = None
        self._warned: tuple[str, float] | None = None

    def start(self) -> UploaderSupervisor:
        self._proc = UploaderProcess(self.config).start()
        return self

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def due(self) -> list[int]:
        """Committed steps the uploader still has to copy, oldest first."""
        return sorted(retention.tier1_upload_holds(
            self.local.complete_steps(), upload_every=self.config.upload_every,
            done=self.local.uploads.uploaded_steps(),
            requested=self.local.uploads.upload_requests(),
            marked=self.local.uploads.upload_marks()))

    def health(self) -> Health:
        """Read the upload records and the child's state (no side effects)."""
        records = self.local.uploads.upload_records().values()
        ok = [r for r in records if r.get("status") == "verified"]
        bad = [r for r in records if r.get("status") in ("failed", "conflict")]
        last_ok = max((float(r.get("updated_unix", 0)) for r in ok), default=None)
        newest_bad = max(bad, key=lambda r: float(r.get("updated_unix", 0)), default=None)
        error = None
        if newest_bad is not None and (last_ok is None or
                                       float(newest_bad.get("updated_unix", 0)) > last_ok):
            error = f"upload of step {newest_bad.get('step')} failed: {newest_bad.get('error')}"
        alive = self._proc is not None and self._proc.poll() is None
        if not alive and self._died is not None:
            error = self._died if error is None else f"{self._died}; {error}"
        return Health(alive=alive, restarts=self.restarts, last_success_unix=last_ok,
                      error=error, due=tuple(self.due()))

    def check(self) -> Health:
        """At each save: restart a dead uploader (back-off), report an unhealthy tier 2."""
        self._restart_if_dead()
        h = self.health()
        if h.error is not None:
            self._warn(h)
        elif h.alive and (h.last_success_unix or 0.0) > self._restarted_unix:
            self._backoff = FIRST_RESTART_S  # it uploaded since its restart: quick again
        return h

    def _restart_if_dead(self) -> None:
        if self._proc is None or (code := self._proc.poll()) is None:
            return
        now = self._clock()
        if self._died is None:  # first noticed: record why, schedule the restart
            self._died = f"the uploader exited with status {code}{self._last_log_line()}"
            self._restart_at = now + self._backoff
            return
        if now < self._restart_at:
            return
        self.restarts += 1
        self.log.emit(events.UPLOADER_RESTARTED, restarts=self.restarts, exit_code=code,
                      reason=self._died)
        _log.warning("tier-2 uploader for %s died (%s); restarting it (restart %d)",
                     self.config.tier1, self._died, self.restarts)
        self._backoff = min(self._backoff * 2, MAX_RESTART_S)  # if it dies again: longer
        self._died = None
        self._restarted_unix = time.time()
        self._proc = UploaderProcess(self.config).start()

    def _last_log_line(self) -> str:
        try:
            lines = (self.local.uploads.upload_state_dir() / UPLOAD_LOG).read_text(
                errors="replace").strip().splitlines()
        except OSError:
            return ""
        return f" ({lines[-1][-300:]})" if lines else ""

    def _warn(self, h: Health) -> None:
        now = self._clock()
        assert h.error is not None
        if self._warned is not None and self._warned[0] == h.error and \
                now - self._warned[1] < self.warn_every_s:
            return
        self._warned = (h.error, now)
        self.log.emit(events.TIER2_UNHEALTHY, error=h.error, due=list(h.due),
                      alive=h.alive, restarts=h.restarts)
        _log.warning("tier 2 (%s) is failing: %s; %d checkpoint(s) wait on tier 1 for upload",
                     self.config.tier2, h.error, len(h.due))

    def close(self, drain_s: float, *, why: str | None = None,
              stop_grace_s: float | None = None) -> list[int]:
        """Stop the uploader; with ``drain_s > 0`` first let it copy what is due, for at most
        ``drain_s`` seconds, then give it ``stop_grace_s`` (default the process's timeout)
        to exit before SIGKILL. Returns the steps left on tier 1 only (warned about loudly,
        with ``why`` when the caller chose not to wait)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return []
        due = self.due() if drain_s > 0 or why is not None else []
        if not due or drain_s <= 0 or proc.poll() is not None:  # nothing / nobody to wait on
            proc.stop(STOP_GRACE_S if why is not None else None)
            return self._report_left(due, 0.0, drain_s, why)
        _log.info("waiting up to %.0f s for the uploader to copy step(s) %s to tier 2",
                  drain_s, due)
        t0 = self._clock()
        proc.finish(drain_s, stop_grace_s=stop_grace_s)
        return self._report_left(self.due(), self._clock() - t0, drain_s)

    def _report_left(self, left: list[int], seconds: float, drain_s: float,
                     why: str | None = None) -> list[int]:
        self.log.emit(events.UPLOAD_DRAINED, seconds=seconds, left=left, why=why)
        if left:
            _log.warning("tier-2 upload did not finish (%s): step(s) %s are on tier 1 only "
                         "(safe there); the next job's uploader or `tierckpt upload` copies "
                         "them", why or f"Tier2.drain_s={drain_s:.0f}", left)
        return left
