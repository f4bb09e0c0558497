"""tier1.pins: pin files by holder, durable and idempotent to remove."""

from __future__ import annotations

from pathlib import Path

from tierckpt.tier1 import pins
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier1.uploads import UPLOAD_HOLDER


def test_pins_by_holder(tmp_path: Path) -> None:
    cat = Tier1Catalog(tmp_path)
    assert pins.read_pins(tmp_path) == {}
    cat.pin(3, UPLOAD_HOLDER)
    cat.pin(3, "eval")
    cat.pin(5, UPLOAD_HOLDER)
    assert cat.pins() == {3: ["eval", UPLOAD_HOLDER], 5: [UPLOAD_HOLDER]}
    cat.unpin_all(UPLOAD_HOLDER)
    assert cat.pins() == {3: ["eval"]}
    pins.unpin(tmp_path, 5, "eval")  # not pinned: nothing to do
    assert pins.read_pins(tmp_path) == {3: ["eval"]}
