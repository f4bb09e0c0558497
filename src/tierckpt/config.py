"""Frozen configuration of :class:`tierckpt.CheckpointManager`: :class:`ManagerConfig`
composes one small config per component — :class:`~tierckpt.tier0.config.Tier0`,
:class:`~tierckpt.tier2.config.Tier2`, :class:`~tierckpt.save.config.Writes` and
:class:`~tierckpt.save.config.Failures` — each validated on its own and handed only to the
component that reads it."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.policy.checks import check_enum
from tierckpt.policy.interval import AutoInterval, Every
from tierckpt.policy.retention import RetentionPolicy
from tierckpt.policy.units import check_count
from tierckpt.preempt.config import Preemption
from tierckpt.restore.verify import Verify
from tierckpt.save.config import Failures, OnSaveError, Staging, Writes
from tierckpt.tier0.config import Tier0, as_tier0
from tierckpt.tier2.config import Tier2, as_tier2

__all__ = ["Failures", "ManagerConfig", "OnSaveError", "Preemption", "Staging", "Tier0",
           "Tier2", "Verify", "Writes"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """What a :class:`CheckpointManager` does; every field is validated on construction.

    The common cases are one-liners: ``tier2="s3://bucket/run"`` (or ``gs://``, ``az://``,
    ``file://``) is ``Tier2(url=...)``, and ``tier0="/dev/shm/job"`` is ``Tier0(path=...)``.
    """

    tier1: Path
    """This process's tier-1 root (node-local or shared; the ranks sharing one are found)."""
    keep_last: int = 3
    """Complete checkpoints kept on tier 1 (pinned ones, e.g. still due for tier 2, too)."""
    verify: Verify = Verify.SIZES
    """How much of a candidate is checked before it is restored (see :class:`Verify`)."""
    interval: Every | AutoInterval | None = None
    """When :meth:`~tierckpt.CheckpointManager.should_save` says yes: ``Every(steps=...)``,
    ``Every(seconds=...)``, or ``AutoInterval(...)`` (Young/Daly from this run's measured
    C, W, R and failures). None: ``should_save()`` is always False; the loop decides."""
    tier0: Tier0 | None = None
    """Node RAM in front of tier 1 (see :class:`~tierckpt.tier0.config.Tier0`); None: off."""
    tier2: Tier2 | None = None
    """Object storage behind tier 1 (see :class:`~tierckpt.tier2.config.Tier2`); None: off."""
    writes: Writes = dataclasses.field(default_factory=Writes)
    """How shards are staged and written (see :class:`~tierckpt.save.config.Writes`)."""
    failures: Failures = dataclasses.field(default_factory=Failures)
    """What failed saves and dead peers do (see :class:`~tierckpt.save.config.Failures`)."""
    preemption: Preemption | None = dataclasses.field(default_factory=Preemption)
    """Termination notices and the emergency save (see
    :class:`~tierckpt.preempt.config.Preemption`); dormant until the loop calls
    ``should_stop()``. None: no handlers, no watcher."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier1", _tier1_path(self.tier1))
        check_count("keep_last", self.keep_last)
        object.__setattr__(self, "verify", check_enum("verify", Verify, self.verify))
        if self.interval == "auto":
            raise ConfigError("interval='auto' is interval=tierckpt.AutoInterval() (Young/Daly "
                              "from this run's measurements)")
        if self.interval is not None and not isinstance(self.interval, Every | AutoInterval):
            raise ConfigError(f"interval must be tierckpt.Every(steps=...|seconds=...), "
                              f"tierckpt.AutoInterval(...) or None, got {self.interval!r}")
        object.__setattr__(self, "tier0", as_tier0(self.tier0))
        object.__setattr__(self, "tier2", as_tier2(self.tier2))
        if self.preemption is not None and not isinstance(self.preemption, Preemption):
            raise ConfigError(f"preemption must be tierckpt.Preemption(...) or None, got "
                              f"{self.preemption!r}")
        for name, kind in (("writes", Writes), ("failures", Failures)):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"{name} must be tierckpt.{kind.__name__}(...), got "
                                  f"{getattr(self, name)!r}")
        _ = self.retention  # validates the knobs as retention reads them

    @property
    def retention(self) -> RetentionPolicy:
        """What each tier keeps: ``keep_last`` here, and tier 2's upload cadence, retention
        and backlog (what ``tierckpt gc`` applies to this root)."""
        t2 = self.tier2
        if t2 is None:
            return RetentionPolicy(keep_last=self.keep_last)
        return RetentionPolicy(keep_last=self.keep_last, upload_every=t2.upload_every,
                               tier2_keep_last=t2.keep_last, tier2_keep_every=t2.keep_every,
                               upload_backlog=t2.backlog)


def _tier1_path(value: object) -> Path:
    if not isinstance(value, str | os.PathLike):
        raise ConfigError(f"tier1 must be a path, got {type(value).__name__}")
    raw = os.fspath(value)
    if isinstance(raw, str) and not raw.strip():
        raise ConfigError(f"tier1 is empty ({raw!r}), which would mean the current directory; "
                          "give the directory for checkpoints, e.g. tier1='/local/ckpt'")
    return Path(raw).expanduser().absolute()


def resolve(config: ManagerConfig | None, fields: dict[str, Any]) -> ManagerConfig:
    """The config a :class:`~tierckpt.CheckpointManager` is built from: ``config``, or one
    made of ``fields`` (its keyword arguments; None or the field's default = not given).
    ConfigError for both, or for neither a config nor ``tier1``."""
    default = {f.name: f.default for f in dataclasses.fields(ManagerConfig)}
    given = {k: v for k, v in fields.items() if v is not None and v != default[k]}
    if config is None:
        if "tier1" not in given:
            raise ConfigError("CheckpointManager needs tier1=<directory for checkpoints>")
        return ManagerConfig(**given)
    if not isinstance(config, ManagerConfig):
        raise ConfigError(f"config must be a tierckpt.ManagerConfig, got "
                          f"{type(config).__name__}; pass the fields as keywords instead")
    if given:
        raise ConfigError(f"pass either a ManagerConfig or keyword arguments, not both "
                          f"(got config= and {sorted(given)})")
    return config
