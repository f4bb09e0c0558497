"""Every Python block in README.md and docs/ stays true to the API.

A block preceded by ``<!-- test: run -->`` (or ``run s3``: against the loopback S3 server)
is a whole program: a journey in tests/journeys/ runs it as printed and asserts what its
page promises (tests/journeys/test_coverage.py keeps every such block covered).

Every other ``python`` block is a fragment (it uses names the page defines elsewhere). It
must parse, every ``tierckpt`` name it imports or reads must exist, and every call to a
public tierckpt callable may pass only keywords that callable accepts — so a renamed or
removed setting cannot survive in the docs.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"(?:<!-- test: (?P<mark>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int
    mark: str
    code: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks() -> list[Block]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            out.append(Block(str(page.relative_to(ROOT)), text.count("\n", 0, m.start()) + 1,
                             (m.group("mark") or "").strip(), textwrap.dedent(m.group("code"))))
    return out


BLOCKS = _blocks()
RUN = [b for b in BLOCKS if b.mark.startswith("run")]
FRAGMENTS = [b for b in BLOCKS if not b.mark]


def test_the_pages_have_blocks_of_both_kinds() -> None:
    assert any(b.page == "README.md" for b in RUN) and len(FRAGMENTS) >= 8
    unknown = [f"{b}: {b.mark!r}" for b in BLOCKS if b.mark and not b.mark.startswith("run")]
    assert not unknown, f"unknown markers (use 'run' or 'run s3'): {unknown}"


# -- fragments ------------------------------------------------------------------------------
def _resolve(dotted: str) -> Any:
    """The object at ``tierckpt.a.b.C`` (module, then attributes); AttributeError if not."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise AttributeError(dotted)


def _names(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted tierckpt path it was imported as."""
    names = {"tierckpt": "tierckpt"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] == "tierckpt":
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "tierckpt":
                    names[a.asname or a.name.split(".")[0]] = (a.asname and a.name) or "tierckpt"
    return names


def _dotted(node: ast.expr, names: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, names)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _accepts(fn: Callable[..., Any], keyword: str) -> bool:
    """Whether ``fn(keyword=...)`` is accepted. ``**kwargs`` forwarded to our manager
    (the Accelerate integration's) is checked against it; to a framework, accepted."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    if keyword in params:
        return True
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return False
    from tierckpt.integrations import accelerate
    from tierckpt.manager import CheckpointManager
    if fn is accelerate.CheckpointManager:
        return keyword in inspect.signature(CheckpointManager).parameters
    return True


def _problems(block: Block) -> list[str]:
    tree = ast.parse(block.code)
    names = _names(tree)
    out = []
    for dotted in sorted(set(names.values())):
        try:
            _resolve(dotted)
        except (AttributeError, ImportError):
            out.append(f"{dotted} does not exist")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node, names)
            if dotted is not None:
                try:
                    _resolve(dotted)
                except (AttributeError, ImportError):
                    out.append(f"{dotted} does not exist")
        if isinstance(node, ast.Call):
            dotted = _dotted(node.func, names)
            if dotted is None and isinstance(node.func, ast.Name):
                public = importlib.import_module("tierckpt").__all__
                dotted = f"tierckpt.{node.func.id}" if node.func.id in public else None
            if dotted is None:
                continue
            try:
                fn = _resolve(dotted)
            except (AttributeError, ImportError):
                continue  # reported above
            if callable(fn):
                out += [f"{dotted}() takes no {k.arg}=" for k in node.keywords
                        if k.arg is not None and not _accepts(fn, k.arg)]
    return sorted(set(out))


@pytest.mark.parametrize("block", FRAGMENTS, ids=str)
def test_fragments_name_only_what_exists(block: Block) -> None:
    try:
        problems = _problems(block)
    except SyntaxError as e:
        pytest.fail(f"{block} does not parse ({e}); make it Python, or a ```text block")
    assert not problems, f"{block}: {problems}"


def test_the_fragment_check_catches_a_stale_setting() -> None:
    stale = Block("x.md", 1, "", "import tierckpt\n"
                  "tierckpt.CheckpointManager(tier1='t', upload_every=5)\n"
                  "tierckpt.Tier3()\n")
    assert _problems(stale) == ["tierckpt.CheckpointManager() takes no upload_every=",
                                "tierckpt.Tier3 does not exist"]
