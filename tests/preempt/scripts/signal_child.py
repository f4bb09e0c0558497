"""A child for tests/preempt/test_signals.py: installs SignalNotices, optionally arms it,
prints READY, and then waits; prints what it saw. Argument 1: "armed" | "plain" |
"previous" (a Python handler was installed before ours)."""

import signal
import sys
import time

from tierckpt.preempt.notice import NoticeBox
from tierckpt.preempt.signals import SignalNotices

mode = sys.argv[1]
if mode == "previous":
    signal.signal(signal.SIGTERM, lambda s, f: (print("PREVIOUS", flush=True), sys.exit(3)))
box = NoticeBox()
notices = SignalNotices(box, (int(signal.SIGTERM), int(signal.SIGUSR1)), grace_s=7.0)
assert notices.arm() if mode == "armed" else notices.install()
print("READY", flush=True)
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    if box.posted >= 2:
        assert box.first is not None
        print(f"NOTICE {box.first.source} {box.posted} "
              f"{box.first.deadline_unix - box.first.received_unix:.1f}", flush=True)
        sys.exit(0)
    time.sleep(0.01)
print("TIMEOUT", flush=True)
sys.exit(1)
