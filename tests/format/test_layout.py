from __future__ import annotations

import pytest

from tierckpt.format import layout


def test_names_roundtrip() -> None:
    assert layout.step_dirname(42) == "step-00000042"
    assert layout.parse_step_dirname("step-00000042") == 42
    assert layout.parse_step_dirname("step-00000042.tmp-x") is None
    assert layout.parse_tmp_dirname(layout.tmp_dirname(7, "r1-7")) == (7, "r1-7")
    assert layout.is_deleting_dirname(layout.deleting_dirname(3, "ab"))
    assert layout.shard_rank(layout.shard_filename(12, 0)) == 12
    assert layout.shard_rank(".metadata") is None
    assert layout.parse_pin_filename(layout.pin_filename(9, "upload")) == 9
    assert layout.object_key("/runs/a/", 3, "COMPLETE") == "runs/a/step-00000003/COMPLETE"
    assert layout.object_key("", 3, "x") == "step-00000003/x"


def test_bad_values() -> None:
    with pytest.raises(ValueError):
        layout.step_dirname(-1)
    with pytest.raises(ValueError):
        layout.pin_filename(1, "a/b")
