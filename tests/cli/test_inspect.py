"""``tierckpt inspect`` and ``tierckpt export`` on a real checkpoint: JSON and table
output, exit statuses, no code run from a planted ``.metadata``."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from rich.console import Console
from torch import nn

import tierckpt
import tierckpt.cli.export  # registers the command
from tests._payload import plant_metadata_payload
from tierckpt.cli.inspect import entries_table
from tierckpt.format import layout
from tierckpt.share.contents import contents
from tierckpt.share.source import open_checkpoint

from ._checkpoints import clone
from ._helpers import invoke, invoke_json


def test_inspect_lists_every_entry_with_totals(template: Path) -> None:
    doc = invoke_json("inspect", "latest", "--tier1", str(template))
    assert doc["step"] == 3 and doc["per_record_crc32c"] is True
    names = {e["name"]: e for e in doc["entries"]}
    w = next(e for n, e in names.items() if n.startswith("model.") and e["shape"]
             and len(e["shape"]) == 2)
    assert w["dtype"] == "float32" and w["bytes"] == w["shape"][0] * w["shape"][1] * 4
    assert w["files"] and all(f.endswith(".distcp") for f in w["files"])
    assert set(doc["totals"]) == {"model", "optim", "rank_state"}
    assert doc["totals"]["model"]["bytes"] == sum(e["bytes"] for e in doc["entries"]
                                                  if e["key"] == "model")
    text = invoke("inspect", "2", "--tier1", str(template), "--key", "model").output
    assert "step 2" in text and "optim." not in text and "per key" in text


def test_inspect_bad_input(template: Path, tmp_path: Path) -> None:
    r = invoke("inspect", "soon", "--tier1", str(template))
    assert r.exit_code == 2 and "latest" in r.output
    r = invoke("inspect", "latest", "--tier1", str(template), "--tier2", "file:///x")
    assert r.exit_code == 2 and "--tier" in r.output
    r = invoke("inspect", "42", "--tier1", str(template))
    assert r.exit_code == 1 and "step 42" in r.output


def test_inspect_unknown_key_is_an_error_naming_the_keys_there(template: Path) -> None:
    for args in (("--key", "nope"), ("--key", "model", "--key", "nope", "--json")):
        r = invoke("inspect", "latest", "--tier1", str(template), *args)
        text = " ".join(r.output.split())
        assert r.exit_code == 2, r.output
        assert "'nope'" in text and "model, optim, rank_state" in text
        assert "per key" not in text and '"entries"' not in text


def test_export_cli_json_and_refusals(template: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    doc = invoke_json("export", "latest", "--tier1", str(template), "--to", str(out),
                      "--max-shard-size", "1kB")
    assert doc["step"] == 3 and doc["tensors"] > 0
    names = {f["name"] for f in doc["files"]}
    assert "model.safetensors.index.json" in names and "SHA256SUMS" in names
    assert all((out / n).is_file() for n in names)
    r = invoke("export", "latest", "--tier1", str(template), "--to", str(out))
    assert r.exit_code == 2 and "--force" in r.output
    r = invoke("export", "latest", "--tier1", str(template), "--to", str(tmp_path / "o2"),
               "--dtype", "int8")
    assert r.exit_code == 2 and "bf16" in r.output
    r = invoke("export", "latest", "--tier1", str(template), "--to", str(tmp_path / "o2"),
               "--keys", "nope")
    assert r.exit_code == 2 and "model, optim, rank_state" in r.output


def test_planted_metadata_never_runs_in_inspect_or_export(template: Path,
                                                          tmp_path: Path) -> None:
    root = clone(template, tmp_path / "t1")
    marker = tmp_path / "pwned"
    plant_metadata_payload(root / layout.step_dirname(3), marker)
    for args in (("inspect", "3", "--tier1", str(root)),
                 ("export", "3", "--tier1", str(root), "--to", str(tmp_path / "o"))):
        r = invoke(*args)
        assert r.exit_code == 1 and "pathlib.Path.touch" in " ".join(r.output.split())
    assert not marker.exists() and not (tmp_path / "o").exists()


LONG = ("encoder_stack_with_a_deliberately_long_module_name", "attention_output_projection",
        "low_rank_adapter_for_the_output")
"""Module names whose dotted tensor name is far wider than 80 columns."""


def _long_name_checkpoint(root: Path) -> str:
    """Commit step 1 of a model with one long-named Linear; return its weight's name."""
    torch.manual_seed(0)
    inner: nn.Module = nn.Linear(2, 2)
    for name in reversed(LONG):
        inner = nn.ModuleDict({name: inner})
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    with tierckpt.CheckpointManager(tier1=root) as ck:
        ck.save(1, tierckpt.TrainState(model=inner, optimizer=opt)).wait(60)
    return "model." + ".".join(LONG) + ".weight"


def test_inspect_prints_long_names_whole(tmp_path: Path) -> None:
    name = _long_name_checkpoint(tmp_path / "t1")
    assert len(name) > 100
    out = invoke("inspect", "latest", "--tier1", str(tmp_path / "t1")).stdout
    assert any(name in line for line in out.splitlines())  # a pipe: one line per entry
    assert "…" not in out
    # A narrow terminal folds the name within its column instead of cutting it.
    with open_checkpoint(str(tmp_path / "t1"), step="latest") as ckpt:
        entries = contents(ckpt).entries
    con = Console(width=60, record=True, file=io.StringIO())
    con.print(entries_table(entries))
    lines = con.export_text().splitlines()
    assert "…" not in "".join(lines) and max(map(len, lines)) <= 60
    assert name in "".join(line.split("│")[0].strip() for line in lines)
