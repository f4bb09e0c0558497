"""What a warm spare imports before it is needed."""

from __future__ import annotations

import tierckpt
from tierckpt.heal.spares import WARM_MODULES


def test_a_spare_warms_every_module_behind_the_lazy_api() -> None:
    lazy = set(tierckpt._LAZY.values())  # the package's own table of lazily imported names
    assert lazy <= set(WARM_MODULES), f"not warmed: {sorted(lazy - set(WARM_MODULES))}"
