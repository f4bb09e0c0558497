"""bench/heal.py end to end at 8 MiB, world 2: the same job healed and fully restarted after
one SIGKILL, R and its parts measured from the job's own events and step log, the steady step
and the downtime beside them, and the table's ratios taken from those rows — never speed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.heal import one, table

pytestmark = pytest.mark.slow  # two 3-process jobs: `make test` only


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("heal")
    return [one(mode, 2, 8, Path(tmp)) for mode in ("heal", "full")]


def test_a_heal_and_a_full_restart_are_measured_part_by_part(
        rows: list[dict[str, Any]]) -> None:
    heal, full = rows
    assert heal["outcome"] == "heal", heal.get("launcher")
    assert full["outcome"] == "full"
    for r in rows:
        assert r["R_s"] > 0 and r["step_s"] > 0
        assert r["downtime_s"] == pytest.approx(r["R_s"] - r["step_s"])
    parts = ("detect_s", "reform_s", "transfer_s", "first_step_s")
    assert all(heal[k] > 0 for k in parts)
    assert sum(heal[k] for k in parts) <= heal["R_s"] + 0.05  # the parts lie inside R
    assert full["reform_s"] is None
    assert full["detect_s"] + full["transfer_s"] + full["first_step_s"] == \
        pytest.approx(full["R_s"], abs=0.05)


def test_the_table_divides_the_heal_by_the_full_restart(rows: list[dict[str, Any]]) -> None:
    heal, full = rows
    line = table(rows).splitlines()[2]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:3] == ["2", "8 MiB", "heal"]
    assert float(cells[9]) == pytest.approx(heal["R_s"] / full["R_s"], abs=0.006)
    assert float(cells[11]) == pytest.approx(heal["downtime_s"] / full["downtime_s"],
                                             abs=0.006)
