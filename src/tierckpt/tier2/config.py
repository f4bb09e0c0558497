"""What tier 2 (object storage) does: :class:`Tier2`, the config that
:class:`tierckpt.ManagerConfig` composes and the tier-2 link is built from. Torch-free."""

from __future__ import annotations

import dataclasses

from tierckpt.errors import ConfigError
from tierckpt.policy.checks import check_bool
from tierckpt.policy.units import check_count, check_seconds
from tierckpt.tier2.storage.url import FORMS, parse_url


@dataclasses.dataclass(frozen=True)
class Tier2:
    """Copy committed checkpoints to object storage and restore from it when tier 1 lacks
    them. ``tier2="s3://bucket/prefix"`` (or ``gs://``, ``az://``, ``file://``) in
    ``ManagerConfig`` is ``Tier2(url=...)``.

    With ``start_uploader`` one low-priority uploader process per tier-1 root copies every
    ``upload_every``-th checkpoint committed on tier 1 (counted, not a step number), and the
    newest one at a clean ``close()``, verifies it end to end, and writes its marker last.
    """

    url: str
    """``s3://bucket/prefix`` (S3 and S3-compatible servers), ``gs://bucket/prefix``
    (Google Cloud Storage), ``az://container/prefix`` (Azure Blob Storage) or
    ``file:///path`` (an existing directory): :data:`tierckpt.tier2.storage.url.FORMS`.
    Endpoints and credentials come from each store's environment (docs/tier2-servers.md),
    never from the URL. ``memory://`` only with ``start_uploader=False`` (in-process
    tests)."""
    _: dataclasses.KW_ONLY
    upload_every: int = 1
    """Every this-many-th checkpoint committed on tier 1 is copied (and held on tier 1 until
    it is, within ``backlog``): the job counts its commits across restarts, so any save
    rule meets any cadence; a clean ``close()`` copies the newest one as well."""
    keep_last: int = 3
    """Newest complete checkpoints kept on tier 2."""
    keep_every: int = 0
    """Steps that are multiples of this are kept on tier 2 forever (0: none)."""
    backlog: int | None = 2
    """At most this many not-yet-uploaded checkpoints are held on tier 1 beyond its
    ``keep_last``; past that the oldest is released with an ``upload_skipped`` event, so a
    tier 2 that is down never fills the disk (None: hold all)."""
    drain_s: float = 600.0
    """On ``close()``, give the uploader up to this long to copy what is still due (the
    final checkpoints are the ones evaluation and serving want), then warn naming what was
    left (0: stop it at once; it resumes from its records next time)."""
    timeout_s: float = 60.0
    """How long the start-up probe and ``restore()`` wait for tier 2 to answer (probe, open,
    list, read a manifest) before going on with tier 1 alone."""
    outage_wait_s: float = 900.0
    """A start that finds no checkpoint on tier 0 or tier 1 while tier 2 (which may hold
    the run) does not answer waits for it this long, trying again with a backoff (5 s
    doubling to 60 s, a warning each time), then raises :class:`Tier2OutageError`: it never
    trains from scratch over tier 2's history, and an outage does not use up the
    launcher's restarts (0: raise at once)."""
    required: bool = False
    """A failing tier 2 (its newest upload failed, or the uploader keeps dying) is a
    :class:`SaveError` at ``save()`` per ``Failures.on_save_error``; by default it is a
    ``tier2_unhealthy`` event and a rate-limited warning."""
    require_conditional_writes: bool = False
    """Refuse a server that ignores ``If-None-Match`` (by default its markers are written and
    read back; see ``tierckpt doctor``)."""
    start_uploader: bool = True
    """Run the uploader process (False: restore from tier 2 only, e.g. in-process tests)."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise ConfigError(f"Tier2.url must be a URL string ({FORMS}), got "
                              f"{self.url!r}")
        check_count("Tier2.upload_every", self.upload_every)
        check_count("Tier2.keep_last", self.keep_last)
        check_count("Tier2.keep_every", self.keep_every, minimum=0)
        if self.backlog is not None:
            check_count("Tier2.backlog", self.backlog, minimum=0)
        check_seconds("Tier2.drain_s", self.drain_s, allow_zero=True)
        check_seconds("Tier2.timeout_s", self.timeout_s)
        check_seconds("Tier2.outage_wait_s", self.outage_wait_s, allow_zero=True)
        for name in ("required", "require_conditional_writes", "start_uploader"):
            check_bool(f"Tier2.{name}", getattr(self, name))
        if parse_url(self.url, name="tier2").scheme == "memory" and self.start_uploader:
            raise ConfigError(
                f"tier2={self.url!r}: memory:// is an in-process store for tests only; the "
                "uploader runs in a child process, so its uploads would go nowhere anyone can "
                f"read. Give {FORMS}, or "
                "Tier2(url, start_uploader=False) in an in-process test")


def as_tier2(value: object) -> Tier2 | None:
    """``ManagerConfig.tier2`` as given (a :class:`Tier2`, a URL, or None) as a
    :class:`Tier2` or None."""
    if value is None or isinstance(value, Tier2):
        return value
    if isinstance(value, str):
        return Tier2(url=value)
    raise ConfigError(f"tier2 must be tierckpt.Tier2(url=...), a URL ({FORMS}), or None, "
                      f"got {value!r}")
