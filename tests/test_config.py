"""ManagerConfig refuses bad configuration when it is constructed, naming the argument and
what to write instead — not later, in a save, an upload or a restore."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tierckpt.config import ManagerConfig
from tierckpt.errors import ConfigError


def _kw(name: str, value: object) -> dict[str, Any]:
    return {name: value}


@pytest.mark.parametrize(("url", "fix"), [
    ("s3://", "s3://bucket/prefix"),  # no bucket
    ("s3://b:9000/p", "AWS_ENDPOINT_URL=http://b:9000"),  # a host:port where the bucket goes
    ("file://relative/p", "file:///absolute/path"),  # a host 'relative', not a relative path
    ("file:relative/p", "file:///absolute/path"),
    ("ftp://x", "s3://bucket/prefix or file:///absolute/path"),
    ("", "s3://bucket/prefix or file:///absolute/path"),
])
def test_bad_tier2_url_is_refused_naming_tier2_and_the_right_form(tmp_path: Path, url: str,
                                                                  fix: str) -> None:
    with pytest.raises(ConfigError) as e:
        ManagerConfig(tier1=tmp_path, tier2=url)
    assert str(e.value).startswith("tier2") and fix in str(e.value), str(e.value)


def test_good_tier2_urls_are_accepted_without_touching_them(tmp_path: Path) -> None:
    missing = tmp_path / "not-yet-mounted"
    for url in ("s3://bucket/run-1", "s3://bucket", missing.as_uri(), "file://localhost/mnt/x"):
        assert ManagerConfig(tier1=tmp_path, tier2=url).tier2 == url
    assert not missing.exists()  # the config is a value: nothing is created or opened


def test_memory_tier2_needs_the_uploader_off(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="in-process store for tests only") as e:
        ManagerConfig(tier1=tmp_path, tier2="memory://x")
    assert "start_uploader=False" in str(e.value) and "s3://bucket/prefix" in str(e.value)
    cfg = ManagerConfig(tier1=tmp_path, tier2="memory://x", start_uploader=False)
    assert cfg.tier2 == "memory://x"


@pytest.mark.parametrize("tier1", ["", "   ", "\t"])
def test_empty_tier1_is_refused_not_taken_as_the_current_directory(tier1: str) -> None:
    with pytest.raises(ConfigError, match=r"tier1 is empty.*current directory"):
        ManagerConfig(tier1=tier1)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["collective_timeout_s", "wait_timeout_s", "upload_drain_s"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_timeouts_must_be_finite(tmp_path: Path, name: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"{name} must be a finite number of seconds"):
        ManagerConfig(tier1=tmp_path, **_kw(name, value))


@pytest.mark.parametrize("name", ["keep_last", "write_threads", "file_mode", "dir_mode",
                                  "collective_timeout_s", "wait_timeout_s", "upload_drain_s",
                                  "background_nice", "upload_every", "tier2_keep_last",
                                  "tier2_keep_every"])
def test_a_bool_is_not_a_number(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        ManagerConfig(tier1=tmp_path, **_kw(name, True))


def test_ordinary_values_still_pass(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"collective_timeout_s": 30, "wait_timeout_s": 0.5,
                          "upload_drain_s": 0, "background_nice": 0, "file_mode": 0o600,
                          "dir_mode": 0o700, "keep_last": 1, "write_threads": 4}
    cfg = ManagerConfig(tier1=str(tmp_path), **kw)  # type: ignore[arg-type]
    assert cfg.tier1 == tmp_path and cfg.upload_drain_s == 0 and cfg.collective_timeout_s == 30
