"""Fault-suite fixtures and the summary of faults tried and checkpoints lost."""

from __future__ import annotations

import pytest

from tests.faults._oracle import TALLY


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not TALLY.tried:
        return
    tr = terminalreporter
    tr.section("tierckpt fault injection")
    tr.write_line(f"{'fault family':<46}{'tried':>7}{'fired':>7}{'lost':>6}")
    for fam in sorted(TALLY.tried):
        tr.write_line(f"{fam:<46}{TALLY.tried[fam]:>7}{TALLY.fired[fam]:>7}"
                      f"{TALLY.lost[fam]:>6}")
    tr.write_line(f"{'total':<46}{sum(TALLY.tried.values()):>7}"
                  f"{sum(TALLY.fired.values()):>7}{sum(TALLY.lost.values()):>6}")
