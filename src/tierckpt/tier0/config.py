"""What tier 0 (node RAM, docs/tier0.md) does: :class:`Tier0`, the config that
:class:`tierckpt.ManagerConfig` composes and the tier-0 session is built from."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from tierckpt.errors import ConfigError
from tierckpt.policy.checks import check_bool
from tierckpt.policy.units import check_count


@dataclasses.dataclass(frozen=True)
class Tier0:
    """Keep checkpoints in node RAM: files on tmpfs that outlive a worker restart.

    Every ``save()`` lands here; every ``tier1_every``-th is also copied to tier 1 in the
    background. Where, one rule: an explicit ``path`` wins; else the directory the launch
    kit sets, ``$TIERCKPT_TIER0`` (a Kubernetes RAM volume of ``--tier0-size``); else
    ``$TIERCKPT_TIER0_BASE``; else ``/dev/shm/tierckpt`` — ``Tier0()`` keeps its root in a
    directory named for the job's tier-1 root under the first of those that is set
    (:func:`tierckpt.tier0.root.auto_base`), and runs without tier 0, with a warning and a
    ``tier0_disabled`` event, where it does not fit or cannot be opened.
    ``Tier0(path="/dev/shm/job")`` uses that directory and makes the same problems a
    :class:`ConfigError`.
    """

    path: Path | None = None
    """A directory on tmpfs; None: the default location (``$TIERCKPT_TIER0`` when set, see
    above), and off where it does not fit."""
    _: dataclasses.KW_ONLY
    keep: int = 1
    """Generations kept in RAM on each node."""
    tier1_every: int = 1
    """Every this-many-th save is also copied to tier 1 (1: every save)."""
    replicate: bool = True
    """Send each node's newest checkpoint to a partner node (node n → n+1 mod N), so a
    replaced node restores from the partner's RAM."""
    bandwidth: float | None = None
    """At most this many bytes/s for the partner copy (e.g. ``500e6``); None: unbounded."""
    keep_on_close: bool = False
    """After a clean ``close()`` the node's RAM copies are removed once the newest is on
    tier 1 (RAM is the next job's); True keeps them for the next incarnation of this job
    (e.g. a requeue on the same nodes). A crash or kill always keeps them."""

    def __post_init__(self) -> None:
        if self.path is not None:
            if not isinstance(self.path, str | os.PathLike) or not os.fspath(self.path):
                raise ConfigError(f"Tier0.path must be a directory on tmpfs or None (the "
                                  f"default location), got {self.path!r}")
            object.__setattr__(self, "path", Path(self.path).expanduser().absolute())
        check_count("Tier0.keep", self.keep)
        check_count("Tier0.tier1_every", self.tier1_every)
        check_bool("Tier0.replicate", self.replicate)
        check_bool("Tier0.keep_on_close", self.keep_on_close)
        bw = self.bandwidth
        if bw is not None and (isinstance(bw, bool) or not isinstance(bw, int | float)
                               or not 0 < bw < math.inf):
            raise ConfigError(f"Tier0.bandwidth must be bytes per second > 0 (e.g. 500e6) "
                              f"or None, got {bw!r}")

    @property
    def auto(self) -> bool:
        """The default location, and no tier 0 (not an error) where it does not fit."""
        return self.path is None


def as_tier0(value: object) -> Tier0 | None:
    """``ManagerConfig.tier0`` as given (a :class:`Tier0`, an absolute directory, or None)
    as a :class:`Tier0` or None; ConfigError for anything else, naming the typed form. A
    relative path (``tier0="yes"``, ``tier0="true"``) is refused: it is far likelier a
    flag's value than a tmpfs directory under the working directory."""
    if value is None or isinstance(value, Tier0):
        return value
    if value == "auto":
        raise ConfigError("tier0='auto' is tier0=tierckpt.Tier0() (the default location, off "
                          "where it does not fit)")
    if isinstance(value, str | os.PathLike) and os.fspath(value):
        path = Path(value).expanduser()
        if not path.is_absolute():
            raise ConfigError(f"tier0={os.fspath(value)!r} is not an absolute directory: give "
                              "one on tmpfs (e.g. tier0='/dev/shm/job'), tier0=tierckpt.Tier0() "
                              "for the default location, or tier0=None for no tier 0")
        return Tier0(path=path)
    raise ConfigError(f"tier0 must be tierckpt.Tier0(...), a directory on tmpfs, or None, "
                      f"got {value!r}")
