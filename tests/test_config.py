"""ManagerConfig and the component configs it composes refuse bad configuration when they
are constructed, naming the field and what to write instead — not later, in a save, an
upload or a restore."""

from __future__ import annotations

import dataclasses
import inspect
import math
from pathlib import Path
from typing import Any

import pytest

import tierckpt
from tierckpt import (
    AutoInterval,
    CheckpointManager,
    Every,
    Failures,
    ManagerConfig,
    OnSaveError,
    Staging,
    Tier0,
    Tier2,
    Verify,
    Writes,
)
from tierckpt.errors import ConfigError
from tierckpt.preempt.config import Preemption
from tierckpt.tier2.storage.url import FORMS


@pytest.mark.parametrize(("url", "fix"), [
    ("s3://", "s3://bucket/prefix"),  # no bucket
    ("s3://b:9000/p", "AWS_ENDPOINT_URL=http://b:9000"),  # a host:port where the bucket goes
    ("file://relative/p", "file:///absolute/path"),  # a host 'relative', not a relative path
    ("file:relative/p", "file:///absolute/path"),
    ("ftp://x", FORMS),  # every form: s3://, gs://, az://, file://
    ("", FORMS),
])
def test_bad_tier2_url_is_refused_naming_tier2_and_the_right_form(tmp_path: Path, url: str,
                                                                  fix: str) -> None:
    with pytest.raises(ConfigError) as e:
        ManagerConfig(tier1=tmp_path, tier2=url)  # type: ignore[arg-type]
    assert str(e.value).startswith("tier2") and fix in str(e.value), str(e.value)


def test_a_url_is_shorthand_for_tier2_and_nothing_is_touched(tmp_path: Path) -> None:
    missing = tmp_path / "not-yet-mounted"
    for url in ("s3://bucket/run-1", "s3://bucket", missing.as_uri(), "file://localhost/mnt/x"):
        cfg = ManagerConfig(tier1=tmp_path, tier2=url)  # type: ignore[arg-type]
        assert cfg.tier2 == Tier2(url)
    assert not missing.exists()  # the config is a value: nothing is created or opened


def test_memory_tier2_needs_the_uploader_off(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="in-process store for tests only") as e:
        Tier2("memory://x")
    assert "start_uploader=False" in str(e.value) and "s3://bucket/prefix" in str(e.value)
    cfg = ManagerConfig(tier1=tmp_path, tier2=Tier2("memory://x", start_uploader=False))
    assert cfg.tier2 is not None and cfg.tier2.url == "memory://x"


@pytest.mark.parametrize("tier1", ["", "   ", "\t"])
def test_empty_tier1_is_refused_not_taken_as_the_current_directory(tier1: str) -> None:
    with pytest.raises(ConfigError, match=r"tier1 is empty.*current directory"):
        ManagerConfig(tier1=tier1)  # type: ignore[arg-type]


@pytest.mark.parametrize(("make", "name"), [
    (lambda v: Failures(collective_timeout_s=v), "Failures.collective_timeout_s"),
    (lambda v: Failures(wait_timeout_s=v), "Failures.wait_timeout_s"),
    (lambda v: Tier2("s3://b/p", drain_s=v), "Tier2.drain_s"),
    (lambda v: Tier2("s3://b/p", timeout_s=v), "Tier2.timeout_s"),
])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_timeouts_must_be_finite(make: Any, name: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"{name} must be a finite number of seconds"):
        make(value)


@pytest.mark.parametrize(("make", "name"), [
    (lambda v: Writes(threads=v), "Writes.threads"),
    (lambda v: Writes(file_mode=v), "Writes.file_mode"),
    (lambda v: Writes(dir_mode=v), "Writes.dir_mode"),
    (lambda v: Writes(background_nice=v), "Writes.background_nice"),
    (lambda v: Failures(collective_timeout_s=v), "Failures.collective_timeout_s"),
    (lambda v: Failures(max_consecutive=v), "Failures.max_consecutive"),
    (lambda v: Tier2("s3://b/p", upload_every=v), "Tier2.upload_every"),
    (lambda v: Tier2("s3://b/p", keep_last=v), "Tier2.keep_last"),
    (lambda v: Tier2("s3://b/p", keep_every=v), "Tier2.keep_every"),
    (lambda v: Tier2("s3://b/p", drain_s=v), "Tier2.drain_s"),
    (lambda v: Tier0(keep=v), "Tier0.keep"),
    (lambda v: Tier0(tier1_every=v), "Tier0.tier1_every"),
    (lambda v: Tier0(bandwidth=v), "Tier0.bandwidth"),
])
def test_a_bool_is_not_a_number(make: Any, name: str) -> None:
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        make(True)


@pytest.mark.parametrize(("make", "name"), [
    (lambda: Writes(fsync=1), "Writes.fsync"),  # type: ignore[arg-type]
    (lambda: Writes(direct_io="yes"), "Writes.direct_io"),  # type: ignore[arg-type]
    (lambda: Tier2("s3://b/p", required="no"), "Tier2.required"),  # type: ignore[arg-type]
    (lambda: Tier0(replicate="yes"), "Tier0.replicate"),  # type: ignore[arg-type]
    (lambda: Writes(staging="async"), "Writes.staging must be one of"),  # type: ignore[arg-type]
    (lambda: Failures(on_save_error="ignore"),  # type: ignore[arg-type]
     "Failures.on_save_error must be one of"),
    (lambda: Writes(file_mode=0o666), "not world-writable"),
])
def test_flags_and_modes_name_the_field_and_the_choices(make: Any, name: str) -> None:
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        make()


def test_strings_of_the_modes_become_the_enums(tmp_path: Path) -> None:
    cfg = ManagerConfig(tier1=tmp_path, verify="full",  # type: ignore[arg-type]
                        writes=Writes(staging="sync"),  # type: ignore[arg-type]
                        failures=Failures(on_save_error="continue"))  # type: ignore[arg-type]
    assert cfg.verify is Verify.FULL and cfg.writes.staging is Staging.SYNC
    assert cfg.failures.on_save_error is OnSaveError.CONTINUE
    with pytest.raises(ConfigError, match=r"verify must be one of \['sizes', 'full'\]"):
        ManagerConfig(tier1=tmp_path, verify="crc")  # type: ignore[arg-type]


def test_auto_strings_name_their_typed_values(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tierckpt\.Tier0\(\)"):
        ManagerConfig(tier1=tmp_path, tier0="auto")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"tierckpt\.AutoInterval\(\)"):
        ManagerConfig(tier1=tmp_path, interval="auto")  # type: ignore[arg-type]
    cfg = ManagerConfig(tier1=tmp_path, tier0=Tier0(), interval=AutoInterval())
    assert cfg.tier0 is not None and cfg.tier0.auto


def test_a_path_is_shorthand_for_tier0(tmp_path: Path) -> None:
    cfg = ManagerConfig(tier1=tmp_path, tier0=str(tmp_path / "ram"))  # type: ignore[arg-type]
    assert cfg.tier0 == Tier0(tmp_path / "ram") and not cfg.tier0.auto
    for bad in (5, ""):
        with pytest.raises(ConfigError, match="tier0 must be"):
            ManagerConfig(tier1=tmp_path, tier0=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["writes", "failures"])
def test_a_group_must_be_its_config(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match=f"{name} must be tierckpt"):
        ManagerConfig(tier1=tmp_path, **{name: {"fsync": False}})


def test_ordinary_values_still_pass(tmp_path: Path) -> None:
    cfg = ManagerConfig(
        tier1=str(tmp_path), keep_last=1, interval=Every(steps=5),  # type: ignore[arg-type]
        writes=Writes(threads=4, background_nice=0, file_mode=0o600, dir_mode=0o700),
        failures=Failures(collective_timeout_s=30, wait_timeout_s=0.5),
        tier2=Tier2("s3://b/run", drain_s=0, upload_every=2, keep_every=100, backlog=None))
    assert cfg.tier1 == tmp_path and cfg.tier2 is not None and cfg.tier2.drain_s == 0
    assert cfg.failures.collective_timeout_s == 30 and cfg.writes.threads == 4
    r = cfg.retention
    assert (r.keep_last, r.upload_every, r.tier2_keep_every, r.upload_backlog) == (1, 2, 100, None)


def test_manager_config_has_nine_fields_each_a_value_or_a_component() -> None:
    names = [f.name for f in dataclasses.fields(ManagerConfig)]
    assert names == ["tier1", "keep_last", "verify", "interval", "tier0", "tier2", "writes",
                     "failures", "preemption"]
    for kind in (Tier0, Tier2, Writes, Failures, Preemption):
        assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_the_manager_signature_mirrors_manager_config() -> None:
    """The typed keywords of CheckpointManager are ManagerConfig's fields with the same
    defaults (None where the config builds a component), so the two cannot drift."""
    params = inspect.signature(CheckpointManager.__init__).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())  # no **kwargs
    for f in dataclasses.fields(ManagerConfig):
        p = params[f.name]
        assert p.kind is p.KEYWORD_ONLY, f.name
        if f.default is not dataclasses.MISSING:
            assert p.default == f.default, f.name
        else:
            assert p.default is None, f.name


def test_the_manager_takes_a_config_or_keywords_not_both(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="either a ManagerConfig or keyword"):
        CheckpointManager(ManagerConfig(tier1=tmp_path), keep_last=5)
    with pytest.raises(ConfigError, match="needs tier1="):
        CheckpointManager()
    with pytest.raises(ConfigError, match=r"must be a tierckpt\.ManagerConfig"):
        CheckpointManager({"tier1": tmp_path})  # type: ignore[arg-type]


def test_every_config_is_public() -> None:
    for name in ("ManagerConfig", "Tier0", "Tier2", "Writes", "Failures", "Verify", "Staging",
                 "OnSaveError", "Every", "AutoInterval"):
        assert name in tierckpt.__all__ and getattr(tierckpt, name).__doc__
