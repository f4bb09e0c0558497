"""Discover, verify and choose what to restore; load it, resharding if the world changed.

Choosing is a collective over domain owners (see ``_topology``): each owner proposes the
newest step that verifies in its own tier-1 root at or below a bound; the bound drops to
the smallest proposal until every owner proposes the same step. A candidate that fails
verification is moved to ``quarantine/`` with its reason (never deleted) and logged, and
the next older one is tried. Nothing a manifest names — DCP's pickled ``.metadata``
included — is opened before the marker, manifest and file sizes (or CRC32C) check out.
"""

from __future__ import annotations

import dataclasses
import io
import os
import stat
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from tierckpt.errors import CheckpointError, IntegrityError, SignatureError, StorageError
from tierckpt.format import checksum, layout
from tierckpt.format import manifest as mf
from tierckpt.restore.reader import DirectReader
from tierckpt.runtime import events
from tierckpt.runtime.topology import Comm
from tierckpt.state import RANK_STATE, TrainState
from tierckpt.tier1 import fs
from tierckpt.tier2.fetch import fetch_into_tier1, remote_manifest
from tierckpt.tier2.storage import Storage
from tierckpt.tier2.uploader import remote_complete_steps


@dataclasses.dataclass(frozen=True)
class RestoreInfo:
    """What ``restore()`` loaded: the step, where from, how long, how many bytes."""

    step: int
    source: str
    path: Path
    seconds: float
    bytes_read: int
    bytes_by_source: dict[str, int]
    world_size: int
    saved_world_size: int
    skipped: tuple[tuple[int, str], ...] = ()

    @property
    def resharded(self) -> bool:
        return self.world_size != self.saved_world_size


def candidate_steps(root: Path) -> list[int]:
    """Every final-named entry under ``root``, newest first (complete or not)."""
    steps = [layout.parse_step_dirname(n) for n in os.listdir(root)]
    return sorted((s for s in steps if s is not None), reverse=True)


class MissingFilesError(IntegrityError):
    """A checkpoint is intact but lacks files this domain needs (node-local tier 1 after a
    reshard, or a replaced node): fetchable from tier 2, not a reason to quarantine it."""

    def __init__(self, message: str, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing


def required_ranks(m: mf.Manifest, domain: tuple[int, ...] | None,
                   world_size: int | None) -> set[int] | None:
    """Ranks whose files a domain must hold to restore ``m``: its own ranks when the job
    has the saved layout (same world size and this domain was a saved domain), else every
    rank (None), since a reshard may read any shard."""
    if domain is None or world_size != m.world_size or tuple(domain) not in m.domains:
        return None
    return set(domain)


def verify_checkpoint(ckpt_dir: Path, *, step: int | None = None,
                      domain: tuple[int, ...] | None = None, world_size: int | None = None,
                      full: bool = False) -> mf.Manifest:
    """Verify one tier-1 checkpoint directory; return its manifest or raise
    :class:`IntegrityError` with the reason (:class:`MissingFilesError` when the only
    problem is files this domain needs but does not hold; see :func:`required_ranks`).
    ``full`` checks every file's CRC32C; DCP's pickled ``.metadata`` is small and is
    CRC-checked always, so a same-size substitute is never unpickled."""
    st = os.lstat(ckpt_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise IntegrityError(f"{ckpt_dir.name} is not a directory (symlink or file)")
    try:
        marker = _read_small(ckpt_dir / layout.COMPLETE)
    except FileNotFoundError:
        raise IntegrityError("no COMPLETE marker (the save never committed)") from None
    try:
        mbytes = _read_small(ckpt_dir / layout.MANIFEST)
    except FileNotFoundError:
        raise IntegrityError("COMPLETE present but manifest.json missing") from None
    m = mf.verify_marker(marker, mbytes, mf.signing_key())
    if step is not None and m.step != step:
        raise IntegrityError(f"directory is named for step {step} but its manifest is step "
                             f"{m.step} (renamed by hand?)")
    ranks = required_ranks(m, domain, world_size)
    wanted = m.files if ranks is None else m.files_for_ranks(ranks)
    missing = []
    for f in wanted:
        p = ckpt_dir / layout.safe_member_name(f.name)
        try:
            fst = os.lstat(p)
        except FileNotFoundError:
            missing.append(f.name)
            continue
        if not stat.S_ISREG(fst.st_mode):
            raise IntegrityError(f"{f.name} is not a regular file")
        if fst.st_size != f.size:
            raise IntegrityError(f"{f.name} has {fst.st_size} bytes, manifest says {f.size}")
        if full or f.name == layout.METADATA:  # the pickle is CRC-checked in every mode
            crc, _ = checksum.of_file(p)
            if crc != f.crc32c:
                raise IntegrityError(f"{f.name} CRC32C {checksum.to_hex(crc)} != manifest "
                                     f"{checksum.to_hex(f.crc32c)}")
    if missing:
        _raise_missing(ckpt_dir, m, missing)
    return m


def _raise_missing(ckpt_dir: Path, m: mf.Manifest, missing: list[str]) -> None:
    """A file of this directory's own saved domain (the domain whose ranks' files are here)
    or a shared file is damage; only other domains' files are fetchable absences."""
    present = {f.rank for f in m.files
               if f.rank is not None and os.path.lexists(ckpt_dir / f.name)}
    home = {r for d in m.domains if set(d) & present for r in d} if len(m.domains) > 1 \
        else set(range(m.world_size))
    own = [f.name for f in m.files if f.name in missing and (f.rank is None or f.rank in home)]
    names = own or missing
    text = (f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''} "
            f"{'is' if len(names) == 1 else 'are'} missing")
    if own:
        raise IntegrityError(text)
    raise MissingFilesError(text + " (held by another node's tier 1)", missing)


def _read_small(p: Path, limit: int = 64 << 20) -> bytes:
    with open(p, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise IntegrityError(f"{p.name} is larger than {limit} bytes")
    return data


class Chooser:
    """Agrees with every domain owner on the newest step restorable everywhere, each
    domain from its own tier 1 when intact there, else from tier 2 (when configured)."""

    def __init__(self, root: Path, comm: Comm, domain: tuple[int, ...], *, is_owner: bool,
                 full: bool, log: events.EventLog, storage: Storage | None = None) -> None:
        self.root, self.comm, self.domain = root, comm, domain
        self.is_owner, self.full, self.log = is_owner, full, log
        self.storage = storage
        self.skipped: list[tuple[int, str]] = []
        self.refused: str | None = None  # a signature failure: restore() raises, everywhere
        self.manifests: dict[int, mf.Manifest] = {}
        self.sources: dict[int, str] = {}
        self._checked: set[int] = set()
        self._remote: list[int] | None = None

    def remote_steps(self) -> list[int]:
        if self._remote is None:
            self._remote = [] if self.storage is None else remote_complete_steps(self.storage)
        return self._remote

    def _skip(self, step: int, reason: str, moved: Path | None = None) -> None:
        self.skipped.append((step, reason))
        self.log.emit(events.CHECKPOINT_SKIPPED, step=step, reason=reason,
                      moved_to=str(moved) if moved else None)

    def _check(self, step: int) -> None:
        """Fill ``sources[step]``/``manifests[step]`` if ``step`` is restorable here."""
        self._checked.add(step)
        d = self.root / layout.step_dirname(step)
        missing_reason = None
        if os.path.lexists(d):
            try:
                self.manifests[step] = verify_checkpoint(
                    d, step=step, domain=self.domain, world_size=self.comm.world_size,
                    full=self.full)
                self.sources[step] = "tier1"
                return
            except MissingFilesError as e:
                missing_reason = str(e)
            except SignatureError as e:
                # Tampering or the wrong key: refuse loudly, move nothing. With a wrong key
                # every candidate fails, and quarantining them all would silently restart
                # training from scratch.
                self.refused = f"{d}: {e}"
                return
            except (IntegrityError, OSError) as e:
                moved = fs.move_aside(d, self.root / layout.QUARANTINE, d.name)
                (moved / "QUARANTINE_REASON").write_text(f"{e}\n")
                self._skip(step, str(e), moved)
        if step in self.remote_steps():
            assert self.storage is not None
            try:
                self.manifests[step] = remote_manifest(self.storage, step)[0]
                self.sources[step] = "tier2"
                return
            except SignatureError as e:
                self.refused = f"tier 2 step {step}: {e}"
                return
            except (IntegrityError, StorageError) as e:
                self._skip(step, f"tier 2: {e}")
        if missing_reason is not None:
            self._skip(step, missing_reason)

    def _newest_valid(self, bound: float) -> int | None:
        for step in sorted(set(candidate_steps(self.root)) | set(self.remote_steps()),
                           reverse=True):
            if step > bound:
                continue
            if step not in self._checked:
                self._check(step)
            if self.refused is not None:
                return None
            if step in self.sources:
                return step
        return None

    def choose(self) -> int | None:
        """Collective. The agreed step, or None when no domain has any checkpoint.
        Raises CheckpointError when some domains can restore and others cannot, and
        :class:`SignatureError` on every rank when a signing key is set and a candidate is
        unsigned or badly signed (it is left where it is, not quarantined)."""
        bound: float = float("inf")
        while True:
            proposal = self._newest_valid(bound) if self.is_owner else "n/a"
            gathered = self.comm.all_gather((proposal, self.refused))
            refused = [r for _, r in gathered if r is not None]
            if refused:
                raise SignatureError(
                    f"refusing to restore {refused[0]}. Set {mf.SIGNING_KEY_ENV} to the key the "
                    "checkpoints were saved with, or move an untrusted checkpoint out of the way")
            props = [p for p, _ in gathered if p != "n/a"]
            if all(p is None for p in props):
                return None
            if any(p is None for p in props):
                raise CheckpointError(
                    "some tier-1 roots have a complete checkpoint and others have none "
                    f"(newest per domain: {props}); a replaced node needs tier 2 (tier2=...) "
                    "to restore")
            low = min(props)
            if all(p == low for p in props):
                return int(low)
            bound = low

    def materialize(self, step: int, *, file_mode: int, dir_mode: int) -> int:
        """Owner only: make ``step`` complete in this domain's tier 1 (fetching what is
        missing from tier 2); returns bytes downloaded."""
        if self.sources.get(step) != "tier2":
            return 0
        assert self.storage is not None
        m = self.manifests[step]
        ranks = required_ranks(m, self.domain, self.comm.world_size)
        names = [f.name for f in (m.files if ranks is None else m.files_for_ranks(ranks))]
        got, _ = fetch_into_tier1(self.storage, self.root, step, names=names, full=self.full,
                                  file_mode=file_mode, dir_mode=dir_mode)
        return got


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor items load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_into(state: TrainState, ckpt_dir: Path, saved_world: int, comm: Comm) -> int:
    """Collective: load ``ckpt_dir`` (already verified) into ``state``; returns bytes read
    by this rank. Different world sizes reshard model/optimizer through DCP; per-rank state
    follows the semantics documented in :mod:`tierckpt.state`."""
    reader = DirectReader(ckpt_dir)
    md = reader.read_metadata()
    src = comm.rank if saved_world == comm.world_size else comm.rank % saved_world
    key = f"{RANK_STATE}.{src}"
    blob_md: Any = md.state_dict_metadata.get(key)
    if blob_md is None:
        raise CheckpointError(f"checkpoint {ckpt_dir} has no per-rank state for rank {src}")
    state._load_source = (src, int(blob_md.size[0]), saved_world)
    try:
        target = state.state_dict()
    finally:
        state._load_source = None
    try:
        dcp.load(target, storage_reader=reader, planner=_SafeLoadPlanner(),
                 process_group=comm.group, no_dist=comm.group is None)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        raise CheckpointError(f"rank {comm.rank}: loading {ckpt_dir} failed: {e}") from e
    state.load_state_dict(target)
    return reader.bytes_read

