"""The heal launcher's environment contract: absent, valid, and malformed."""

from __future__ import annotations

import pytest

from tierckpt.errors import ConfigError
from tierckpt.runtime import healenv


def test_absent_means_not_started_by_the_heal_launcher() -> None:
    assert healenv.read({}) is None
    assert healenv.read({healenv.ENV_ID: ""}) is None


def test_keys_and_prefixes_name_the_start_and_the_generation() -> None:
    env = healenv.read({healenv.ENV_ID: "abc", healenv.ENV_GEN: "2",
                        healenv.ENV_TIMEOUT: "5"})
    assert env == healenv.HealEnv("abc", 2, 5.0)
    assert env.key("gen") == "tierckpt/heal/abc/gen"
    assert env.pg_prefix() == "tierckpt/abc/gen2/" and env.pg_prefix(3) == "tierckpt/abc/gen3/"
    assert healenv.read({healenv.ENV_ID: "abc"}) == healenv.HealEnv(
        "abc", 0, healenv.DEFAULT_TIMEOUT_S)


@pytest.mark.parametrize("gen, timeout", [("x", "1"), ("-1", "1"), ("0", "0"), ("0", "soon")])
def test_malformed_values_name_the_variable(gen: str, timeout: str) -> None:
    with pytest.raises(ConfigError, match=healenv.ENV_GEN):
        healenv.read({healenv.ENV_ID: "abc", healenv.ENV_GEN: gen,
                      healenv.ENV_TIMEOUT: timeout})
