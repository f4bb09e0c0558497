"""``tierckpt report``: a run's goodput as JSON, as a table and as a picture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tierckpt.cli.report  # noqa: F401  (registers the command)
from tests.cli._helpers import flags, invoke, invoke_json
from tests.policy.test_goodput import _preempted_run, _run


@pytest.fixture
def events_file(tmp_path: Path) -> Path:
    root = tmp_path / "t1"
    root.mkdir()
    (root / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _run()))
    return root


def test_json_sums_to_the_wall_time(events_file: Path) -> None:
    doc = invoke_json("report", "--tier1", str(events_file))
    assert doc["wall_s"] == 79.0 and sum(doc["seconds"].values()) == pytest.approx(79.0)
    assert doc["failures"] == 1 and doc["saves"] == 3 and 0 < doc["goodput"] < 1
    with_model = invoke_json("report", "--events", str(events_file / "events.jsonl"),
                             "--node-mtbf", "1h")
    assert with_model["predicted_waste"] is not None


def test_table_and_plot(events_file: Path, tmp_path: Path) -> None:
    png = tmp_path / "goodput.png"
    r = invoke("report", "--tier1", str(events_file), "--plot", str(png))
    text = " ".join(r.stdout.split())
    assert r.exit_code == 0 and "lost work" in text and "goodput" in text and "1 failure" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_source_exits_2(tmp_path: Path) -> None:
    r = invoke("report", "--tier1", str(tmp_path / "nope"))
    assert r.exit_code == 2 and "events" in " ".join(r.stderr.split())


def test_flags_are_frozen() -> None:
    assert flags("report") == {"--tier1", "--events", "--node-mtbf", "--nodes", "--plot", "--json"}


@pytest.fixture
def preempted_root(tmp_path: Path) -> Path:
    root = tmp_path / "t1"
    root.mkdir()
    (root / "events.jsonl").write_text("".join(json.dumps(r) + "\n"
                                               for r in _preempted_run()))
    return root


def test_json_splits_announced_from_unannounced(preempted_root: Path) -> None:
    doc = invoke_json("report", "--tier1", str(preempted_root))
    assert doc["failures"] == 1 and doc["announced"] == 1
    kinds = doc["interruptions_by_kind"]
    assert kinds["announced"]["count"] == 1 and kinds["announced"]["lost_steps"] == 0
    assert kinds["unannounced"]["lost_steps"] == 5
    assert kinds["announced"]["restart_s"] == pytest.approx(110 - 75.6)
    assert sum(doc["seconds"].values()) == pytest.approx(doc["wall_s"])


def test_table_shows_each_kind(preempted_root: Path, tmp_path: Path) -> None:
    png = tmp_path / "goodput.png"
    r = invoke("report", "--tier1", str(preempted_root), "--plot", str(png))
    text = " ".join(r.stdout.split())
    assert r.exit_code == 0, r.output
    for fragment in ("1 failure(s)", "1 announced preemption(s)", "interruptions",
                     "unannounced", "34.4 s",
                     "emergency save committed"):
        assert fragment in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_under_a_scheduler_the_table_names_each_requeue(tmp_path: Path) -> None:
    from tests.policy.test_goodput import _slurm_run

    root = tmp_path / "t1"
    root.mkdir()
    (root / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _slurm_run()))
    r = invoke("report", "--tier1", str(root))
    assert r.exit_code == 0, r.output
    rows = [" ".join(line.replace("│", " ").split()) for line in r.stdout.splitlines()]
    assert "+0.0 s slurm 812 0 0 fresh 0–24 unannounced" in rows
    assert "+50.0 s slurm 812 0 1 19 20–35 announced" in rows
    assert "+100.0 s slurm 812 1 0 35 36–45 —" in rows
    doc = invoke_json("report", "--tier1", str(root))
    assert [(i["requeue"], i["restart_count"]) for i in doc["incarnations"]] == [
        (0, 0), (0, 1), (1, 0)]


def test_the_uploads_line_shows_what_throttling_cost(tmp_path: Path) -> None:
    root = tmp_path / "t1"
    root.mkdir()
    uploads = [  # the uploader's events: a throttled failed attempt, then two verified steps
        {"event": "upload_failed", "t": 20.0, "step": 10, "source": "uploader",
         "throttled_requests": 40, "throttled_s": 12.5},
        {"event": "upload_verified", "t": 41.0, "step": 10, "bytes": 3_000_000_000,
         "source": "uploader", "throttled_requests": 2, "throttled_s": 0.5},
        {"event": "upload_verified", "t": 60.0, "step": 20, "bytes": 3_000_000_000,
         "source": "uploader"}]
    (root / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*_run(), *uploads]))
    doc = invoke_json("report", "--tier1", str(root))
    assert doc["tier2_uploads"] == {"verified": 2, "failed": 1, "bytes": 6_000_000_000,
                                    "referenced": 6_000_000_000, "throttled_requests": 42,
                                    "throttled_s": 13.0}
    assert doc["wall_s"] == 79.0  # the uploader's events do not change the run's accounting
    text = " ".join(invoke("report", "--tier1", str(root)).stdout.split())
    assert ("tier 2: 2 upload(s) verified (6.0 GB), 1 failed attempt(s); throttled: 42 "
            "request(s) refused for their rate, 13.0 s waiting to send them again") in text


def test_the_uploads_line_shows_what_tier_2_already_held(tmp_path: Path) -> None:
    """Content-addressed tier 2: the second step sent only what changed; the line says how
    much of what the steps refer to was already there."""
    root = tmp_path / "t1"
    root.mkdir()
    uploads = [
        {"event": "upload_verified", "t": 41.0, "step": 10, "bytes": 3_000_000_000,
         "referenced": 3_000_000_000, "source": "uploader"},
        {"event": "upload_verified", "t": 60.0, "step": 20, "bytes": 40_000_000,
         "referenced": 3_000_000_000, "source": "uploader"}]
    (root / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*_run(), *uploads]))
    doc = invoke_json("report", "--tier1", str(root))
    assert (doc["tier2_uploads"]["bytes"], doc["tier2_uploads"]["referenced"]) == (
        3_040_000_000, 6_000_000_000)
    text = " ".join(invoke("report", "--tier1", str(root)).stdout.split())
    assert ("tier 2: 2 upload(s) verified (3.0 GB sent of 6.0 GB referenced: 3.0 GB already "
            "on tier 2), 0 failed attempt(s); never throttled") in text
