"""bench/preempt.py end to end at 8 MiB on the session's SeaweedFS: every world's notice
chain reaches tiers 0, 1 and 2 in that order after every rank stopped, at the notice's step
or the next, and the watcher's cost is measured with and without — never speed."""

from __future__ import annotations

import os
from typing import Any

import pytest

from bench.preempt import NOTICE_AT, markdown, measure_preempt
from tests._bench_tier2 import server_env

pytestmark = pytest.mark.slow  # spawned ranks at two world sizes: `make test` only

MiB = 1 << 20


@pytest.fixture(scope="module")
def section(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> dict[str, Any]:
    with server_env(s3_server, "t-preempt") as url:
        return measure_preempt(tmp_path_factory.mktemp("preempt"), 8 * MiB, url=url,
                               blocks=1, steps=20)


def test_the_notice_chain_reaches_every_tier_in_order(section: dict[str, Any]) -> None:
    assert section["server"] == "given"
    assert [n["world"] for n in section["notice"]] == [1, 2]
    for n in section["notice"]:
        assert NOTICE_AT <= n["step"] <= NOTICE_AT + 1, n
        assert n["reached"] == ["tier0", "tier1", "tier2"] and n["abandoned"] == {}, n
        assert 0 <= n["stop_s"] <= n["tier0_s"] <= n["tier1_s"] <= n["tier2_s"], n
        assert n["bytes"] > 7 * MiB and n["warm_upload_s"] > 0


def test_the_watchers_cost_is_measured_with_and_without(section: dict[str, Any]) -> None:
    for c in section["cost"]:
        assert c["with_s"] > 0 and c["without_s"] > 0 and c["matmuls_per_step"] >= 1
        assert c["ratio"] == pytest.approx(c["with_s"] / c["without_s"])


def test_the_table_names_each_world(section: dict[str, Any]) -> None:
    text = "\n".join(markdown(section))
    assert "Notice → stop → durable" in text and "watcher's cost" in text
    assert text.count("\n| 1 |") == 2 and text.count("\n| 2 |") == 2
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("tierckpt-bench-preempt-")]


def test_a_skipped_section_says_so() -> None:
    assert "**Skipped:** off" in "\n".join(markdown({"skipped": "off"}))
