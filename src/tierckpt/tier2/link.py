"""The job's side of tier 2, from start-up to close: the probe (collective, bounded), one
uploader supervisor per domain owner, its health at every save, and the drain at close.
Built from :class:`~tierckpt.tier2.config.Tier2` alone. Torch-free: the ranks' collective
is any object with ``rank`` and ``all_gather`` (:class:`Gather`)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from tierckpt.errors import CheckpointError, ConfigError, SaveError
from tierckpt.policy.retention import RetentionPolicy
from tierckpt.runtime import events
from tierckpt.runtime.deadline import call_with_deadline
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.session import Gather
from tierckpt.tier2 import probe
from tierckpt.tier2.config import Tier2
from tierckpt.tier2.storage.url import parse_url
from tierckpt.tier2.uploader import UploaderConfig
from tierckpt.tier2.uploader.supervisor import UploaderSupervisor

_log = logging.getLogger("tierckpt")

NOTICE_STOP_GRACE_S = 1.0
"""After a notice's drain, the seconds the uploader gets to exit before SIGKILL (within the
notice's margin: an upload cut off writes no marker, so nothing partial is trusted)."""


class Tier2Link:
    """Tier 2 as one job sees it. Call :meth:`probe` once (collective), then :meth:`start`
    (domain owners start their uploader), :meth:`check` at every save, and :meth:`close`
    at the end (idempotent)."""

    def __init__(self, config: Tier2, *, catalog: Tier1Catalog, comm: Gather,
                 is_owner: bool) -> None:
        self.config, self.catalog, self.comm, self.is_owner = config, catalog, comm, is_owner
        self._uploader: UploaderSupervisor | None = None
        self._store_options: dict[str, Any] = {}
        self._started_unix = time.time()
        self.down: str | None = None
        """Why tier 2 did not answer the start-up probe (on owners; None: it answered or
        was not probed). A restore does not wait on it again, and ``close`` does not
        drain into it unless it answered since."""

    def probe(self, *, dir_mode: int) -> None:
        """Collective: owners probe tier 2 once, within ``timeout_s``, and keep the options
        that give their uploader the modes it chose, whatever the object store
        (:meth:`~tierckpt.tier2.probe.ProbeResult.store_options`). A tier 2 that can never
        work (missing bucket, refused credentials, no integrity mode, a file:// root that
        does not exist) is a ConfigError now, on every rank; one that does not answer is
        only a warning: an outage must not stop a job that can restore from tier 1 (its
        uploader probes again when it starts)."""
        cfg, err = self.config, None
        if self.is_owner:
            url = cfg.url
            try:
                result = call_with_deadline(lambda: probe.probe_url(url), cfg.timeout_s,
                                            f"probing tier 2 {url}")
                self.catalog.write_tier2_probe(result.to_json(), dir_mode=dir_mode)
                probe.require_usable(result, conditional_writes=cfg.require_conditional_writes)
                self._store_options = result.store_options()
                for weaker in result.modes.weaker:
                    _log.warning("tier 2 %s: %s", url, weaker)
            except ConfigError as e:
                if _missing_dir(url):  # an unmounted file system: an outage, not a typo
                    self.down = f"{url} is not there ({e})"
                    _log.warning("tier 2 %s is not there (%s); starting from tier 1 — mount "
                                 "it: the uploader retries", url, e)
                else:
                    err = str(e)
            except (CheckpointError, OSError) as e:  # TimeoutError is an OSError
                self.down = f"{type(e).__name__}: {e}"
                _log.warning("tier 2 %s did not answer the start-up probe (%s); starting "
                             "without it: restores use tier 1, the uploader keeps trying", url, e)
        errors = [e for e in self.comm.all_gather(err) if e]
        if errors:
            raise ConfigError(errors[0])

    def start(self, retention: RetentionPolicy, log: events.EventLog, *, file_mode: int,
              dir_mode: int) -> None:
        """Owners record the retention ``tierckpt gc`` applies to this root and, with
        ``start_uploader``, start the uploader process."""
        cfg = self.config
        if not self.is_owner:
            return
        self.catalog.write_policy(tier2=cfg.url, policy=retention, file_mode=file_mode,
                                  dir_mode=dir_mode)
        if cfg.start_uploader:
            self._uploader = UploaderSupervisor(UploaderConfig(
                tier1=self.catalog.root, tier2=cfg.url, upload_every=cfg.upload_every,
                keep_last=cfg.keep_last, keep_every=cfg.keep_every,
                storage_options=self._store_options), log=log).start()

    def check(self, *, raise_error: bool) -> None:
        """At each save: restart a dead uploader and report a failing tier 2. With
        ``required`` (collective then) a failing tier 2 is a SaveError on every rank when
        ``raise_error``, else logged."""
        health = self._uploader.check() if self._uploader is not None else None
        if not self.config.required:
            return
        err = None if health is None or health.healthy else \
            f"rank {self.comm.rank}: tier 2 {self.config.url} is failing: {health.error}"
        errors = [e for e in self.comm.all_gather(err) if e]
        if not errors:
            return
        failure = SaveError(f"Tier2.required and {'; '.join(errors)}")
        if raise_error:
            raise failure
        _log.error("%s (on_save_error=continue)", failure)

    def close(self, *, drain: bool, drain_s: float | None = None) -> list[int] | None:
        """Stop the uploader: first let it copy what is due for up to ``drain_s`` (default
        ``Tier2.drain_s``; an emergency save passes what is left of its grace) when
        ``drain`` (a clean close), else at once (it resumes from its records). A tier 2
        that has not answered since this process started (the probe got no answer and no
        upload has verified since) gets no drain: the steps left on tier 1 are named.
        Returns those steps (None: this rank runs no uploader)."""
        if self._uploader is None:
            return None
        uploader, self._uploader = self._uploader, None
        if drain and self.down is not None:
            last = uploader.health().last_success_unix
            if last is None or last < self._started_unix:
                return uploader.close(0.0, why=f"tier 2 has not answered since this job "
                                               f"started ({self.down}); not waiting for it")
        if drain_s is None:
            return uploader.close(self.config.drain_s if drain else 0.0)
        # a notice's drain: the deadline bounds it, and a copy cut off is killed promptly
        return uploader.close(min(drain_s, self.config.drain_s) if drain else 0.0,
                              stop_grace_s=NOTICE_STOP_GRACE_S)


def _missing_dir(url: str) -> bool:
    """A ``file://`` tier 2 whose directory does not exist (yet): never created by us, but
    a mount that is down is an outage — the job must still restart from tier 1."""
    if not url.startswith("file://"):
        return False
    return not os.path.lexists(parse_url(url).location)
