"""``tierckpt size`` through the real CLI."""

from __future__ import annotations

import pytest

from ._helpers import flags, invoke, invoke_json


def test_design_example_70b_over_8_nodes() -> None:
    doc = invoke_json("size", "--params", "70e9", "--nodes", "8", "--gpus-per-node", "8",
                      "--node-ram", "2TiB", "--reserve", "512GiB", "--node-write-gbps", "4")
    assert doc["bytes_per_param"] == 14
    assert doc["bytes_per_param_parts"] == {"weights": 2, "master": 4, "optimizer": 8}
    assert doc["total_bytes"] == 980 * 10**9
    assert doc["per_node_bytes"] == 122_500_000_000
    assert doc["per_rank_bytes"] == 15_312_500_000
    assert doc["write"]["write_s"] == pytest.approx(30.625)
    ram = doc["ram"]
    assert ram["fits"] is True
    assert ram["reserve_bytes"] == 512 * 2**30
    assert ram["margin_bytes"] == 2 * 2**40 - 512 * 2**30 - 122_500_000_000


def test_8b_and_fp32_weights() -> None:
    assert invoke_json("size", "--params", "8B")["total_bytes"] == 112 * 10**9
    doc = invoke_json("size", "--params", "70B", "--weights", "fp32")
    assert doc["bytes_per_param"] == 12


def test_does_not_fit_on_a_small_node_and_default_reserve() -> None:
    doc = invoke_json("size", "--params", "70e9", "--nodes", "2", "--node-ram", "512GiB")
    ram = doc["ram"]
    assert ram["fits"] is False and ram["margin_bytes"] < 0
    assert ram["reserve_bytes"] == 128 * 2**30  # 25 % default
    assert ram["reserve_source"].startswith("default")


def test_human_output_shows_breakdown_and_verdict() -> None:
    result = invoke("size", "--params", "70e9", "--nodes", "8", "--node-ram", "2TiB",
                    "--node-write-gbps", "4")
    assert result.exit_code == 0, result.output
    out = result.stdout
    for fragment in ("980.0 GB", "122.5 GB", "fits", "30.6 s", "fp32 master"):
        assert fragment in out


@pytest.mark.parametrize(("args", "flag"), [
    (("--params", "70Q"), "--params"),
    (("--params", "70e9", "--node-ram", "2TX"), "--node-ram"),
    (("--params", "70e9", "--optimizer", "lion"), "--optimizer"),
    (("--params", "70e9", "--nodes", "0"), "--nodes"),
    (("--params", "70e9", "--node-write-gbps", "0"), "--node-write-gbps"),
    (("--params", "70e9", "--reserve", "1GiB"), "--reserve"),
])
def test_bad_input_exits_2_naming_the_flag(args: tuple[str, ...], flag: str) -> None:
    result = invoke("size", *args)
    assert result.exit_code == 2
    assert flag in result.stderr
    assert "error" in result.stderr
    assert result.stdout == ""


def test_flag_set_is_frozen() -> None:
    """Scripts depend on these flags: adding one is fine (update this list), renaming is not."""
    assert flags("size") == {
        "--extra", "--gpus-per-node", "--json", "--master-fp32", "--no-master-fp32",
        "--node-ram", "--node-write-gbps", "--nodes", "--optimizer", "--params",
        "--reserve", "--weights"
    }
