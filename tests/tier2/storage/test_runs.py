"""Sibling runs under one prefix (``?run=NAME``, tier2/storage/runs.py): a run's keys live
under ``runs/<NAME>/`` and the content objects at the shared prefix; a run lists and deletes
its own steps only; the URL opens it on every scheme."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierckpt.errors import ConfigError
from tierckpt.format import checksum
from tierckpt.tier2.storage import LocalStorage, open_storage
from tierckpt.tier2.storage.runs import RunStorage, validate_run


def test_a_runs_steps_live_under_runs_and_its_content_at_the_prefix(tmp_path: Path) -> None:
    base = LocalStorage(tmp_path)
    a, b = RunStorage(base, "a"), RunStorage(base, "b")
    a.put_bytes("step-00000001/COMPLETE", b"m")
    a.put_bytes("objects/sha256/00ff", b"shared")
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 10)
    info = b.put_file("step-00000002/__0_0.distcp", src, crc32c=checksum.extend(0, b"x" * 10),
                      size=10)
    assert info.key == "step-00000002/__0_0.distcp"  # keys come back as the run wrote them
    assert (tmp_path / "runs/a/step-00000001/COMPLETE").read_bytes() == b"m"
    assert (tmp_path / "runs/b/step-00000002/__0_0.distcp").is_file()
    assert (tmp_path / "objects/sha256/00ff").read_bytes() == b"shared"
    assert [i.key for i in a.list("step-")] == ["step-00000001/COMPLETE"]  # its own only
    assert [i.key for i in a.list()] == ["objects/sha256/00ff", "step-00000001/COMPLETE"]
    assert [i.key for i in b.list("objects/")] == ["objects/sha256/00ff"]  # shared
    assert b.get_bytes("objects/sha256/00ff") == b"shared"
    assert b.head("step-00000001/COMPLETE") is None  # a's step is not b's
    assert a.get_range("step-00000001/COMPLETE", 0, 1) == b"m"
    b.delete("step-00000001/COMPLETE")  # a key b does not have: nothing of a's goes
    assert a.head("step-00000001/COMPLETE") is not None
    assert a.url == f"{base.url}?run=a" and a.integrity == base.integrity


def test_a_run_url_opens_its_run_on_the_shared_prefix(tmp_path: Path) -> None:
    with open_storage(f"{tmp_path.as_uri()}?run=lora-a") as st:
        assert isinstance(st, RunStorage) and st.run == "lora-a"
        st.put_bytes("step-00000003/manifest.json", b"{}")
    assert (tmp_path / "runs/lora-a/step-00000003/manifest.json").is_file()
    with pytest.raises(ConfigError, match="object-store options were given"):
        open_storage(f"{tmp_path.as_uri()}?run=a", part_size=1)


@pytest.mark.parametrize("name", ["", ".a", "a/b", "a b", "x" * 65, "-a"])
def test_a_bad_run_name_says_what_to_write(name: str) -> None:
    with pytest.raises(ConfigError, match=r"\?run=lora-a"):
        validate_run(name)
