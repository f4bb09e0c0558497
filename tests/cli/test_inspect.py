"""``tierckpt inspect`` and ``tierckpt export`` on a real checkpoint: JSON and table
output, exit statuses, no code run from a planted ``.metadata``."""

from __future__ import annotations

from pathlib import Path

import tierckpt.cli.export
import tierckpt.cli.inspect  # noqa: F401  (register the commands)
from tests._payload import plant_metadata_payload
from tierckpt.format import layout

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
