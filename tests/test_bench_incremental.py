"""bench/incremental.py end to end at 8 MiB on the session's SeaweedFS: the section's shape and
what incremental saves must show in bytes (staged, written, uploaded) — never speed."""

from __future__ import annotations

from typing import Any

import pytest

from bench.incremental import MODES, SHAPES, markdown, measure_incremental
from tests._bench_tier2 import server_env

pytestmark = pytest.mark.slow

MiB = 1 << 20


@pytest.fixture(scope="module")
def section(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> dict[str, Any]:
    with server_env(s3_server, "t-incremental") as url:
        return measure_incremental(tmp_path_factory.mktemp("incr"), 8 * MiB, repeats=2,
                                   url=url)


def test_every_shape_and_mode_is_measured(section: dict[str, Any]) -> None:
    assert section["server"] == "given" and set(section["shapes"]) == set(SHAPES)
    for sh in section["shapes"].values():
        assert set(sh["modes"]) == set(MODES)
        for mode, m in sh["modes"].items():
            assert len(m["saves"]) == 3 and m["C_s"] > 0 and m["durable_s"] > 0
            assert (m["uploaded_bytes"] is None) == (mode == "dcp")


def test_the_lora_base_is_neither_staged_nor_written_nor_uploaded_again(
        section: dict[str, Any]) -> None:
    lora = section["shapes"]["lora"]
    assert lora["frozen_bytes"] > 150 * lora["trainable_bytes"]  # ~0.5 % adapters
    inc, full = lora["modes"]["incremental"], lora["modes"]["full"]
    first = inc["saves"][0]
    assert first["written_bytes"] >= lora["frozen_bytes"]  # the warm-up wrote the base
    assert first["uploaded_bytes"] >= lora["frozen_bytes"]
    r = lora["ratios"]
    for key in ("staged_vs_full", "written_vs_full", "uploaded_vs_full_save"):
        assert r[key] < 0.1, (key, r)
    assert full["uploaded_bytes"] >= lora["frozen_bytes"]  # one file: sent whole every time
    # a sibling fine-tune of the same base under the same prefix (?run=sibling): its first
    # upload is its adapters and their optimizer state, not the base again
    assert r["sibling_first_upload_vs_full"] < 0.1, r
    assert lora["sibling"]["referenced_bytes"] >= lora["frozen_bytes"]


def test_frozen_embeddings_skip_their_quarter(section: dict[str, Any]) -> None:
    sh = section["shapes"]["frozen_embeddings"]
    share = sh["frozen_bytes"] / (sh["frozen_bytes"] + sh["trainable_bytes"])
    inc, full = sh["modes"]["incremental"], sh["modes"]["full"]
    # what is left is the trainable parameters and their AdamW moments (3x their size)
    assert inc["written_bytes"] < full["written_bytes"] - 0.9 * sh["frozen_bytes"]
    assert 0.2 < share < 0.3


def test_the_table_names_each_row(section: dict[str, Any]) -> None:
    text = "\n".join(markdown(section))
    for shape in SHAPES:
        for mode in MODES:
            assert f"| {shape} | {mode} |" in text
    assert "uploaded vs a full save" in text
