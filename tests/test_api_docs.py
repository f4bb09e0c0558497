"""The API reference (docs/api/build.py, ``make docs``) builds from the docstrings with pdoc
and is whole: pdoc's warnings are errors, every public name is on the page with a
docstring, the config classes and the sampler document each argument, and no docstring
refers to a tierckpt name that does not exist."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

import tierckpt

ROOT = Path(__file__).resolve().parents[1]


def _builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("api_build", ROOT / "docs" / "api" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_builds_whole(tmp_path: Path) -> None:
    problems = _builder().build(tmp_path / "api")
    assert problems == []
    page = (tmp_path / "api" / "tierckpt.html").read_text()
    assert (tmp_path / "api" / "index.html").is_file()
    for name in tierckpt.__all__:
        assert f'id="{name}"' in page, name
    for cls, field in (("Tier0", "keep"), ("Tier2", "upload_every"), ("Failures",
                       "wait_timeout_s"), ("Preemption", "grace_s")):
        assert f'id="{cls}.{field}"' in page, (cls, field)  # each field has its entry


def test_a_name_that_does_not_resolve_fails_the_build(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tierckpt, "__all__", [*tierckpt.__all__, "Tier3"])
    problems = _builder().build(tmp_path / "api")
    assert any("tierckpt.Tier3 is in __all__ but does not resolve" in p for p in problems)
    assert any(p.startswith("pdoc: UserWarning") and "Tier3" in p for p in problems)


def test_the_checks_catch_a_broken_reference_and_an_undocumented_field() -> None:
    import pdoc.doc

    build = _builder()
    assert build._resolves("tierckpt.tier0.root.default_root")
    assert build._resolves("tierckpt.Tier0")
    assert not build._resolves("tierckpt.Tier3")
    assert not build._resolves("tierckpt.tier0.root.no_such_function")
    text = "See :class:`~tierckpt.Tier3` and ``tierckpt.errors.ConfigError`` and `tierckpt.load()`."
    assert build._REF.findall(text) == ["tierckpt.Tier3", "tierckpt.errors.ConfigError",
                                        "tierckpt.load"]

    @dataclasses.dataclass(frozen=True)
    class Knobs:
        """Knobs: ``documented`` is said here."""

        documented: int = 1
        silent: int = 2

    cls = pdoc.doc.Class(__name__, "Knobs", Knobs, (__name__, "Knobs"))
    [problem] = build._undocumented_fields(cls)
    assert "'silent' is not documented" in problem
