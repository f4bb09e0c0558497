"""The one save in flight, and what the next ``save()`` does about it: wait (with a
timeout), raise its error or — with ``on_save_error="continue"`` — log it until too many
fail in a row, and never let a new save stage into the buffers a stuck one still reads."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from tierckpt.errors import SaveError
from tierckpt.runtime import events
from tierckpt.save.config import Failures, OnSaveError
from tierckpt.save.saver import SaveHandle, SaveResult

_log = logging.getLogger("tierckpt")


class InFlight:
    """Tracks the in-flight :class:`SaveHandle` of one manager. ``stuck``: it outlived a
    wait of ``wait_timeout_s`` (it keeps its host buffers until it ends); ``failures``:
    consecutive failed saves."""

    def __init__(self, config: Failures, log: events.EventLog) -> None:
        self.config, self.log = config, log
        self.handle: SaveHandle | None = None
        self.stuck = False
        self.failures = 0

    def settle(self) -> tuple[SaveResult | None, SaveError | None]:
        """Before a save: ``(the previous save's result, None)`` or, when the new save
        must be skipped (continue mode, the previous one stuck), ``(None, the error)``.
        Raises the previous save's SaveError per ``on_save_error``."""
        cfg = self.config
        try:  # a save known to be stuck is only polled, not waited for again
            return self.finish(record_overlap=True,
                               timeout=0.0 if self.stuck else None), None
        except SaveError as e:
            self.failures += 1
            if cfg.on_save_error is OnSaveError.RAISE:
                raise
            if self.failures >= cfg.max_consecutive:
                raise SaveError(f"{self.failures} checkpoint saves in a row failed "
                                f"(Failures.max_consecutive="
                                f"{cfg.max_consecutive}); last: {e}") from e
            _log.error("previous checkpoint save failed; continuing (on_save_error=continue): "
                       "%s", e)
            return None, (e if self.handle is not None else None)

    def skipped(self, step: int, why: SaveError) -> SaveHandle:
        """The handle of a save that was not attempted (continue mode): it holds the error."""
        err = SaveError(f"save of step {step} skipped: {why}")
        self.log.emit(events.SAVE_FAILED, step=step, error=str(err))
        staged: Future[float] = Future()
        staged.set_result(0.0)
        durable: Future[SaveResult] = Future()
        durable.set_exception(err)
        return SaveHandle(step=step, staged=staged, durable=durable)

    def finish(self, *, record_overlap: bool, timeout: float | None = None
               ) -> SaveResult | None:
        """Wait for the in-flight save (``timeout`` default: ``wait_timeout_s``). Raises
        SaveError when it failed (it is then gone) or is still writing after the wait (it
        stays in flight, marked stuck)."""
        h = self.handle
        if h is None:
            return None
        t0 = time.monotonic()
        was_running = not h.done()
        wait_s = self.config.wait_timeout_s if timeout is None else timeout
        try:
            result = h.wait(wait_s)
        except TimeoutError:
            self.stuck = True
            raise SaveError(f"save of step {h.step} still writing after {wait_s:.0f} s "
                            "(wait_timeout_s); it keeps its host buffers until it ends") from None
        except SaveError:
            self.handle, self.stuck = None, False
            raise
        finally:
            if record_overlap and was_running and not self.stuck:
                self.log.emit(events.OVERLAP, step=h.step, seconds=time.monotonic() - t0)
        self.handle, self.stuck, self.failures = None, False, 0
        return result
