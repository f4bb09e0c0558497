"""``tierckpt.load``: read part of a checkpoint (by default the model) into a module or a
state dict, from tier 1 or tier 2, at any world size — without the rest of the checkpoint.

This is the reader for evaluation, fine-tuning and serving jobs: it never writes to the
checkpoint's tier, needs no ``CheckpointManager``, and works in one process without a
process group as well as collectively in a distributed job (FSDP2/DTensor destinations
are filled with their own shards; DCP reshards from however the checkpoint was saved).
Only the requested top-level keys' records are fetched, each verified against its
manifest CRC32C before use (:mod:`tierckpt.share.ranged`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from tierckpt._torch.dcp import flatten_state_dict
from tierckpt.errors import CheckpointError, ConfigError, StateMismatchError
from tierckpt.restore.loader import SafeLoadPlanner
from tierckpt.share.ranged import RangedReader, ReadCheck, VerifyMode
from tierckpt.share.source import Step, open_checkpoint


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """What :func:`load` read. ``state_dict`` holds the loaded tensors (per key when
    several keys were asked for; the destination's own state dict when one was given)."""

    step: int
    tier: str
    location: str
    keys: tuple[str, ...]
    tensors: int
    bytes_read: int
    checkpoint_bytes: int
    seconds: float
    verified: str
    """``"chunks"`` (every record against its own CRC32C) or ``"files"`` (some or all
    files read whole and checked against the file CRC32C: see ``notes``)."""
    notes: tuple[str, ...]
    state_dict: dict[str, Any] = dataclasses.field(repr=False)
    """Not in the repr: it may hold millions of tensors."""


def top_level_keys(md: Metadata) -> list[str]:
    """The checkpoint's top-level keys (``model``, ``optim``, ``rank_state``, ...)."""
    return sorted({fqn.split(".", 1)[0] for fqn in md.state_dict_metadata})


def require_keys(md: Metadata, keys: Sequence[str], where: str) -> None:
    """ConfigError naming the first of ``keys`` the checkpoint lacks, and those it has."""
    have = top_level_keys(md)
    unknown = [k for k in keys if k not in have]
    if unknown:
        raise ConfigError(f"{where} has no key {unknown[0]!r}; its keys are {', '.join(have)}")


def load(source: str | Any, into: Any = None, *, step: Step = "latest",
         keys: Sequence[str] = ("model",), verify: VerifyMode = "chunks",
         threads: int = 8, strict: bool = True) -> LoadResult:
    """Load ``keys`` of the newest committed checkpoint at ``source`` (or ``step``).

    ``source``: a tier-1 root, a step directory, or a tier-2 URL (``s3://bucket/prefix``,
    ``gs://bucket/prefix``, ``az://container/prefix``, ``file:///dir``). ``into``: an
    ``nn.Module`` (plain, DDP, FSDP2) or a state dict whose tensors are filled in place
    (plain tensors or DTensors) — for one key; a mapping ``{key: module or state dict}``
    for several; None to get full plain tensors of every entry under the keys
    (``result.state_dict``). In a distributed job every rank must call
    it (the load is collective, as ``dcp.load`` is); otherwise no process group is needed.

    Raises :class:`~tierckpt.errors.ConfigError` for an unknown key (listing those there),
    :class:`~tierckpt.errors.StateMismatchError` when ``into`` has entries the checkpoint
    lacks or holds with another shape (``strict=False`` loads only the common ones),
    :class:`~tierckpt.errors.CorruptDataError` for a record that does not match its
    CRC32C, :class:`~tierckpt.errors.NoCheckpointError` when nothing committed is there.
    """
    if isinstance(keys, str) or not keys:
        raise ConfigError(f"keys must be a non-empty sequence of names, got {keys!r}")
    keys = tuple(keys)
    t0 = time.perf_counter()
    with open_checkpoint(source, step=step) as ckpt:
        md = ckpt.metadata()
        require_keys(md, keys, ckpt.location)
        targets, modules = _targets(into, keys, md)
        _check(targets, md, ckpt.location, strict)
        reader = RangedReader(ckpt, verify=verify, threads=threads)
        distributed = dist.is_available() and dist.is_initialized()
        try:
            dcp.load(targets, storage_reader=reader, planner=SafeLoadPlanner(),
                     no_dist=not distributed)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            raise _unwrap(e) from e
        finally:
            reader.close()
        for key, module in modules.items():
            set_model_state_dict(module, targets[key], options=StateDictOptions(strict=strict))
        fetcher = reader.fetcher
        notes = []
        whole = sorted(fetcher.whole_files)
        if whole:
            why = ("verify='files'" if reader.fetcher.verify is ReadCheck.FILES else
                   "this checkpoint predates per-record CRC32Cs")
            notes.append(f"{len(whole)} file(s) read whole and verified by file CRC32C "
                         f"({why}): {', '.join(whole[:4])}{' …' if len(whole) > 4 else ''}")
        notes += [f"skipped step {s}: {r}" for s, r in ckpt.skipped]
        flat, _ = flatten_state_dict(targets)
        return LoadResult(
            step=ckpt.step, tier=ckpt.tier, location=ckpt.location, keys=keys,
            tensors=sum(isinstance(v, torch.Tensor) for v in flat.values()),
            bytes_read=ckpt.bytes_read, checkpoint_bytes=ckpt.manifest.total_bytes,
            seconds=time.perf_counter() - t0, verified="files" if whole else "chunks",
            notes=tuple(notes),
            state_dict=targets[keys[0]] if len(keys) == 1 else targets)


def _unwrap(e: BaseException) -> BaseException:
    """Our own error inside DCP's CheckpointException (from whichever rank raised it);
    anything else as it came."""
    if isinstance(e, KeyboardInterrupt | SystemExit):
        return e
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for _rank, (exc, _tb) in sorted(failures.items()):
            if isinstance(exc, CheckpointError):
                return exc
        first = next(iter(failures.values()), None)
        if first is not None:
            return CheckpointError(f"loading failed: {type(first[0]).__name__}: {first[0]}")
    return e


def _targets(into: Any, keys: tuple[str, ...], md: Metadata
             ) -> tuple[dict[str, Any], dict[str, nn.Module]]:
    """``({key: state dict to fill}, {key: module to set afterwards})``."""
    if into is None:
        return {k: _fresh(md, k) for k in keys}, {}
    per_key = ({keys[0]: into} if len(keys) == 1 else dict(into)
               if isinstance(into, Mapping) and set(into) == set(keys) else None)
    if per_key is None:
        raise ConfigError(f"with several keys {list(keys)}, into must be a dict with exactly "
                          "those keys (each a module or a state dict)")
    targets: dict[str, Any] = {}
    modules: dict[str, nn.Module] = {}
    for k, dest in per_key.items():
        if isinstance(dest, nn.Module):
            targets[k] = get_model_state_dict(dest)
            modules[k] = dest
        elif isinstance(dest, Mapping):
            targets[k] = dest
        else:
            raise ConfigError(f"into[{k!r}] must be an nn.Module or a state dict, got "
                              f"{type(dest).__name__}")
    return targets, modules


def _fresh(md: Metadata, key: str) -> dict[str, Any]:
    """Full plain tensors for every tensor entry under ``key`` (flat names, key stripped)."""
    out: dict[str, Any] = {}
    for fqn, entry in md.state_dict_metadata.items():
        head, _, rest = fqn.partition(".")
        if head == key and isinstance(entry, TensorStorageMetadata):
            out[rest] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    return out


def _check(targets: dict[str, Any], md: Metadata, where: str, strict: bool) -> None:
    """Refuse (or, non-strict, drop) destinations the checkpoint lacks or shapes that
    differ, before anything is read."""
    saved = md.state_dict_metadata
    bad: list[str] = []
    for key, sd in targets.items():
        flat, _ = flatten_state_dict({key: sd})
        for fqn, value in flat.items():
            if not isinstance(value, torch.Tensor):
                continue
            entry = saved.get(fqn)
            if entry is None:
                bad.append(f"{fqn}: not in the checkpoint")
            elif isinstance(entry, TensorStorageMetadata) and \
                    tuple(entry.size) != tuple(value.shape):
                bad.append(f"{fqn}: checkpoint {tuple(entry.size)}, destination "
                           f"{tuple(value.shape)}")
    if bad and strict:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise StateMismatchError(f"the destination does not match {where} ("
                                 f"{'; '.join(bad[:3])}{more}); nothing was read. Build the "
                                 "model the checkpoint was saved from, or pass strict=False")
    if bad:
        for key in targets:
            targets[key] = _drop(targets[key], {b.split(":", 1)[0] for b in bad}, key)


def _drop(sd: Any, fqns: set[str], prefix: str) -> Any:
    if not isinstance(sd, Mapping):
        return sd
    return {k: _drop(v, fqns, f"{prefix}.{k}") for k, v in sd.items()
            if f"{prefix}.{k}" not in fqns}
