"""A scrub of all of tier 2 (ops/scrub.py, ``tierckpt verify --all --tier 2``): every
complete step checked with each shared object read once, a damaged object named with every
step it breaks, and mended from tier 1 with ``--repair``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.cli._helpers import assert_full_bar
from tests.ops.test_repair import CLI, FROZEN, _three_steps
from tests.tier2.test_content import BASE
from tierckpt.format import layout
from tierckpt.ops.check import check_tier2
from tierckpt.ops.scrub import scrub_tier2
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import LocalStorage, ObjectInfo, Storage


class CountingGets:
    """A storage that counts the downloads of each key (a fake wrapper, not a mock)."""

    def __init__(self, inner: Storage) -> None:
        self.inner, self.gets = inner, dict[str, int]()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_file(self, key: str, path: Any, *, crc32c: int | None = None) -> ObjectInfo:
        self.gets[key] = self.gets.get(key, 0) + 1
        return self.inner.get_file(key, path, crc32c=crc32c)


def test_each_shared_object_is_read_once_and_names_every_step_it_breaks(
        tmp_path: Path) -> None:
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    key = _three_steps(t1, Tier2Catalog(LocalStorage(t2)), flip_after=3)
    st = CountingGets(LocalStorage(t2))
    heard: list[tuple[int, int]] = []
    r = scrub_tier2(st,  # type: ignore[arg-type]
                    progress=lambda done, total: heard.append((done, total)))
    assert r.steps == (1, 2, 3) and not r.ok and r.repaired == ()
    assert r.objects == len(BASE) + 2  # the base, and steps 2 and 3's new adapters
    assert set(st.gets.values()) == {1} and len(st.gets) == r.objects
    assert [s for s, _ in r.bad] == [1, 2, 3] and all(FROZEN in why for _, why in r.bad)
    assert st.gets[key] == 1
    # the progress heard: 0 first, then once per object, never going back, ending at all
    assert heard[0] == (0, r.bytes) and heard[-1] == (r.bytes, r.bytes)
    assert len(heard) == r.objects + 1 and [d for d, _ in heard] == sorted(d for d, _ in heard)


def test_repair_mends_every_step_and_a_damaged_marker_is_reported(tmp_path: Path) -> None:
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    st = LocalStorage(t2)
    key = _three_steps(t1, Tier2Catalog(st), flip_after=1)
    marker = t2 / layout.step_dirname(2) / layout.COMPLETE
    marker.write_bytes(marker.read_bytes()[:-3] + b"xyz")
    r = scrub_tier2(st, tier1=t1)
    assert r.repaired == ((key, str(t1 / layout.step_dirname(3) / FROZEN)),)
    ((step, why),) = r.bad  # the marker is no object: reported, never rewritten
    assert step == 2 and f"{layout.step_dirname(2)}/{layout.COMPLETE}" in why
    assert check_tier2(st, 1).ok and check_tier2(st, 3).ok


def test_the_cli_scrubs_and_repairs(tmp_path: Path) -> None:
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t2.mkdir()
    _three_steps(t1, Tier2Catalog(LocalStorage(t2)), flip_after=2)
    url = f"file://{t2}"
    bad = subprocess.run([*CLI, "verify", "--all", "--tier", "2", "--tier2", url],
                         capture_output=True, text=True)
    assert bad.returncode == 1, bad.stderr
    out = " ".join(bad.stdout.split())
    assert "bad: step 1:" in out and "bad: step 2:" in out and "bad: step 3:" in out
    assert "3 of 3 complete steps on tier 2" in " ".join(bad.stderr.split())
    fixed = subprocess.run([*CLI, "verify", "--all", "--tier", "2", "--tier2", url,
                            "--repair", "--tier1", str(t1), "--json"],
                           capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stderr
    doc = json.loads(fixed.stdout)
    assert doc["ok"] is True and doc["steps"] == [1, 2, 3] and len(doc["repaired"]) == 1
    clean = subprocess.run([*CLI, "verify", "--all", "--tier", "2", "--tier2", url],
                           capture_output=True, text=True)
    assert clean.returncode == 0 and "3 steps on tier 2" in " ".join(clean.stdout.split())
    assert_full_bar(clean.stderr, "scrub")
    for argv, says in ((["verify", "--tier", "2", "--tier2", url], "give the STEP"),
                       (["verify", "2", "--all", "--tier", "2", "--tier2", url], "no STEP"),
                       (["verify", "--all", "--tier", "2", "--tier2", url, "--repair"],
                        "give --tier1 DIR")):
        wrong = subprocess.run([*CLI, *argv], capture_output=True, text=True)
        assert wrong.returncode == 2 and says in " ".join(wrong.stderr.split()), wrong.stderr
