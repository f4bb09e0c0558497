"""``bench/gpu.py`` and ``bench/gpu.sh`` on CPU: every section produces numbers, the FSDP2
kill-and-resume is bit for bit, the files are written, the script parses and its dry run
(``GPU_BENCH_DEVICE=cpu``) works. Speed is never asserted. The CUDA run itself is
``bench/gpu.sh`` on a GPU machine (its exit status says whether every check held), not a
test that would be skipped here.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import gpu, gpu_report, gpu_resume

# multi-process jobs or benchmarks (a module fixture runs them): in `make test`, not
# in `make test-fast`
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu.sh"
MEASUREMENT = {"seconds", "bytes", "gbps", "runs"}
Run = tuple[dict[str, Any], str, Path]


def _bench(base: Path, *args: str) -> Run:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", *args, "--out", str(base / "out"),
         "--target", str(base / "target")],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    (json_path,) = (base / "out").glob("*-gpu.json")
    (md_path,) = (base / "out").glob("*-gpu.md")
    assert json_path.name.removesuffix(".json") == md_path.name.removesuffix(".md")
    return json.loads(json_path.read_text()), md_path.read_text(), base


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _bench(tmp_path_factory.mktemp("gpu"), "--device", "cpu", "--mib", "16",
                  "--repeats", "2")


def _measurement(m: dict[str, Any], nbytes: int) -> None:
    assert m.keys() >= MEASUREMENT, m
    assert m["seconds"] > 0 and m["bytes"] == nbytes and m["seconds"] == min(m["runs"])


@pytest.mark.slow
def test_results_files_and_cpu_mode(cpu_run: Run) -> None:
    r, md, base = cpu_run
    assert r["schema"] == gpu.SCHEMA and r["errors"] == [] and r["finished"]
    assert r["config"]["device"] == "cpu" and r["config"]["mib"] == 16
    assert r["config"]["sections"] == list(gpu.SECTIONS)
    assert r["device"]["requested"] == "cpu" and r["device"]["cores"] >= 1
    assert set(r["cpu_mode"]) == set(gpu.SECTIONS)  # every replacement is declared
    assert set(r["sections"]) == set(gpu.SECTIONS)
    assert all(s["section_seconds"] > 0 for s in r["sections"].values())
    rows = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    data = rows[1:]  # after the header
    assert len(data) >= 12 and all(row.endswith("| CPU stand-in |") for row in data)
    assert "every number below is a CPU stand-in" in md
    assert not any((base / "target").iterdir()), "checkpoints left behind"


def test_d2h_section(cpu_run: Run) -> None:
    s = cpu_run[0]["sections"]["d2h"]
    n = s["bytes"]
    assert n > 8 << 20 and s["tensors"] == 3 * 4 * 6  # (param, 2 moments) × 6 per block
    for key in ("plain", "stage_sync", "overlap_blocked", "overlap_landed"):
        _measurement(s[key], n)
    assert s["ratio"] == pytest.approx(s["stage_sync"]["gbps"] / s["plain"]["gbps"])
    assert s["target"] == gpu.D2H_TARGET and s["met"] is None  # the target is CUDA's
    assert s["ordered"] == {"sync": True, "overlap": True} and s["verified"] is True
    assert s["allocations_steady"] is True and s["pinned_reserved_bytes"] is None
    assert len(s["overlap_cpu_per_wall"]) == 2


def test_blocking_section(cpu_run: Run) -> None:
    s = cpu_run[0]["sections"]["blocking"]
    assert s["model"]["dim"] == gpu.model_dim(16 << 20) and s["model"]["params"] > 0
    assert s["step_seconds"]["seconds"] > 0
    assert list(s["variants"]) == list(gpu.VARIANTS)
    for name, v in s["variants"].items():
        assert "error" not in v, (name, v)
        _measurement(v["blocked"], s["bytes"])
        assert len(v["call"]) == len(v["wait"]) == len(v["lost"]) == 2
        assert all(d >= c for d, c in zip(v["durable"], v["call"], strict=True))
        assert v["vs_dcp_default"] > 0 and v["vs_best_dcp"] > 0
        assert ("gate_blocked" in v) == name.startswith("tierckpt_")
    assert s["variants"]["dcp_default"]["vs_dcp_default"] == pytest.approx(1.0)
    assert "no pinning" in s["variants"]["dcp_stager"]["note"]


def test_fsdp_resume_bit_identical_on_cpu(cpu_run: Run) -> None:
    s = cpu_run[0]["sections"]["fsdp_resume"]
    assert s["ok"] and s["bit_identical"] and s["max_abs_diff"] == 0.0
    assert s["tolerance"] == {"mode": "exact", "rtol": 0.0}
    steps, every, killed = s["steps"], s["save_every"], s["killed_after"]
    resumed_from = (killed + 1) // every * every - 1  # the newest save at or before the kill
    assert s["restored_step"] == resumed_from
    assert s["resumed_rows"] == steps - resumed_from - 1 and s["missing"] == []
    assert s["compared"] == (killed + 1) + s["resumed_rows"]
    attempts = [m["attempt"] for m in s["meta"]]
    assert attempts == [0, 1] and s["meta"][1]["restored_step"] == resumed_from
    assert {m["backend"] for m in s["meta"]} == {"gloo"}
    assert {m["checkpoint_backend"] for m in s["meta"]} == {"gloo"}
    assert {m["staging"] for m in s["meta"]} == {"overlap"}


def test_cuda_rendering(cpu_run: Run) -> None:
    """The table of a CUDA run (rendered from a doctored CPU result: no GPU needed)."""
    r = copy.deepcopy(cpu_run[0])
    r["config"]["device"], r["cpu_mode"] = "cuda", None
    r["device"].update(name="NVIDIA H200", capability="9.0", count=1, torch_cuda="13.0",
                       nccl="2.27.7")
    d2h = r["sections"]["d2h"]
    d2h.update(met=False, pinned_reserved_bytes=2 * d2h["bytes"])
    r["sections"]["fsdp_resume"]["tolerance"] = {"mode": "rtol",
                                                 "rtol": gpu_resume.CUDA_RESUME_RTOL}
    md = gpu_report.render_markdown(r)
    assert "NVIDIA H200" in md and "CPU stand-in" not in md
    assert "**missed**" in md and "pinned reserved 2.00×" in md and "rtol 1e-05" in md
    assert all(row.endswith("| cuda |") for row in md.splitlines()[5:] if row.startswith("| "))


def test_model_dim_tracks_the_state_size() -> None:
    for mib in (16, 64, 2048):
        dim = gpu.model_dim(mib << 20)
        params = gpu.LAYERS * (8 * dim * dim + 7 * dim)
        assert dim % 64 == 0 and 0.6 < 12 * params / (mib << 20) < 1.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_refused_without_a_device(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu.main(["--device", "cuda"])
    assert exc.value.code == 2 and "sees no CUDA device" in capsys.readouterr().err


def test_bad_sections_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu.main(["--device", "cpu", "--sections", "d2h,nope"])
    assert exc.value.code == 2 and "nope" in capsys.readouterr().err


def test_gpu_sh_parses() -> None:
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert os.access(SCRIPT, os.X_OK)


@pytest.mark.slow
def test_gpu_sh_dry_run(tmp_path: Path) -> None:
    """The script end to end with the CPU stand-ins (one section, to keep it short)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_BENCH_DEVICE": "cpu",
           "GPU_BENCH_MIB": "8", "GPU_BENCH_REPEATS": "1", "GPU_BENCH_SECTIONS": "d2h",
           "GPU_BENCH_TARGET": str(tmp_path / "target"), "OMP_NUM_THREADS": "1",
           "PYTHON": sys.executable}
    proc = subprocess.run([str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert [n for n in names if not n.endswith(("-gpu.json", "-gpu.md"))] == \
        ["gpu-env.txt", "gpu-run.log"]
    env_txt = (tmp_path / "out" / "gpu-env.txt").read_text()
    assert f"torch {torch.__version__}" in env_txt and "imports: all there" in env_txt
    (result,) = (tmp_path / "out").glob("*-gpu.json")
    assert set(json.loads(result.read_text())["sections"]) == {"d2h"}
