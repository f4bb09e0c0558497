"""Tier-1 retention after each commit: what :func:`~tierckpt.policy.retention` drops is
unpublished here and reclaimed by the saver once the save's handle resolved. Runs on the
saver's worker thread, on domain owners only."""

from __future__ import annotations

import logging
from pathlib import Path

from tierckpt.policy.retention import RetentionPolicy
from tierckpt.runtime import events
from tierckpt.save.saver import SaveResult
from tierckpt.tier1.catalog import Tier1Catalog

_log = logging.getLogger("tierckpt")


class Tier1Retention:
    """``retention(result)``: unpublish what ``policy`` drops from ``catalog``'s root and
    return the directories to reclaim. With ``uploader`` (a tier 2 is configured), each
    commit is first counted for the upload cadence (every ``upload_every``-th is marked due:
    :meth:`~tierckpt.tier1.catalog.Tier1Catalog.count_commit`), and what the uploader has
    yet to copy is kept — up to ``policy.upload_backlog`` checkpoints; older
    ones are released with an ``upload_skipped`` event, so the disk stays bounded while
    tier 2 is down."""

    def __init__(self, catalog: Tier1Catalog, policy: RetentionPolicy, *, uploader: bool,
                 log: events.EventLog) -> None:
        self.catalog, self.policy, self.uploader, self.log = catalog, policy, uploader, log

    def __call__(self, result: SaveResult) -> list[Path]:
        if self.uploader and self.catalog.uploads.count_commit(
                result.step, upload_every=self.policy.upload_every):
            self.log.emit(events.UPLOAD_DUE, step=result.step,
                          upload_every=self.policy.upload_every)
        plan = self.catalog.retention_plan(self.policy, uploader=self.uploader)
        for step in plan.released:
            reason = (f"Tier2.backlog={self.policy.upload_backlog} newer checkpoints already "
                      "wait for the upload; tier 1 keeps its bound")
            self.log.emit(events.UPLOAD_SKIPPED, step=step, reason=reason)
            _log.warning("step %d will not be copied to tier 2 (%s): the newer checkpoints "
                         "are complete on tier 1 and next in line for tier 2; nothing the job "
                         "resumes from is lost", step, reason)
        return [self.catalog.unpublish(step) for step in plan.delete]
