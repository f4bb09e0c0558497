"""tests/_require.py: a missing tool skips a test on a developer machine, fails it in CI."""

from __future__ import annotations

import pytest

from tests._require import require


def test_missing_tool_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"strace.*CI=true"):
        require(False, "needs strace")
    require(True, "needs strace")  # present: nothing happens


def test_missing_tool_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs strace"):
        require(False, "needs strace")


def test_fault_suite_modules_use_it() -> None:
    """The strace-driven fault modules require strace through this helper, not skipif."""
    from pathlib import Path
    faults = Path(__file__).parent / "faults"
    for name in ("test_fault_kill_sweep.py", "test_fault_rank_kill.py",
                 "test_fault_restore_kill.py", "test_fault_disk_errors.py"):
        text = (faults / name).read_text()
        assert "require(_sweep.strace_usable()" in text and "skipif" not in text, name
