"""bench/model_state.py end to end at 8 MiB: the section's shape, that every figure comes
from its own runs, and the table — never speed."""

from __future__ import annotations

from typing import Any

import pytest

from bench.model_state import LAYERS, SAVES, markdown, measure_model_state, width_for

# multi-process jobs or benchmarks (a module fixture runs them): in `make test`, not
# in `make test-fast`
pytestmark = pytest.mark.slow

MiB = 1 << 20


@pytest.fixture(scope="module")
def section(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return measure_model_state(tmp_path_factory.mktemp("model"), 8 * MiB, repeats=1)


@pytest.mark.slow
def test_the_model_is_many_tensors_of_about_the_size_asked(section: dict[str, Any]) -> None:
    m = section["model"]
    assert m["layers"] == LAYERS and m["parameters"] == 12 * LAYERS
    assert m["tensors"] == 48 * LAYERS  # parameters + AdamW's step, exp_avg, exp_avg_sq
    assert 4 * MiB <= m["state_bytes"] <= 16 * MiB


def test_every_figure_is_the_median_of_its_own_runs(section: dict[str, Any]) -> None:
    import statistics

    for key, per_repeat in section["runs"].items():
        assert len(per_repeat) == 1, key
        want = SAVES // 2 if key.startswith("restore") else SAVES
        assert len(per_repeat[0]) == want and min(per_repeat[0]) > 0, key
        assert section["seconds"][key] == statistics.median(per_repeat[0])
    s = section["seconds"]
    assert section["overlap_vs_dcp"] == s["tierckpt_overlap"] / s["dcp_async_save"]
    assert section["restore_vs_dcp"] == s["restore_tierckpt"] / s["restore_dcp"]


def test_the_table_names_each_measurement(section: dict[str, Any]) -> None:
    md = "\n".join(markdown(section))
    for text in ("staging='overlap'", "staging='sync'", "dcp.async_save", "memcpy",
                 "set_state_dict", f"{section['model']['tensors']} tensors"):
        assert text in md
    assert markdown({"skipped": "off"})[-2] == "**Skipped:** off"


def test_width_follows_the_size() -> None:
    assert width_for(8 * MiB) == 64 and width_for(128 * MiB) == 256
    assert width_for(1) == 64
