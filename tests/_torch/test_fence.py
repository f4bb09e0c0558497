"""Torch's private names appear in one part only, ``_torch/`` (STYLE.md habit 16): every
other module of the package names none — not in an import, not in an attribute of a torch
module — and a feature built on them declines on a torch that was not tested."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tierckpt import _torch

SRC = Path(__file__).resolve().parents[2] / "src" / "tierckpt"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_torch_names(source: str) -> list[str]:
    """``line: name`` for every private torch name ``source`` uses: a private module or
    name imported from torch, or a private attribute of a name bound to a torch module."""
    tree = ast.parse(source)
    torch_names: set[str] = set()
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    torch_names.add((a.asname or a.name).split(".")[0])
                    found += [f"{node.lineno}: {a.name}" for p in a.name.split(".")
                              if _private(p)][:1]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            module = node.module or ""
            if any(_private(p) for p in module.split(".")):
                found.append(f"{node.lineno}: {module}")
            for a in node.names:
                torch_names.add(a.asname or a.name)
                if _private(a.name):
                    found.append(f"{node.lineno}: {module}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in torch_names:
                found.append(f"{node.lineno}: {root.id}...{node.attr}")
    return found


def test_no_private_torch_name_outside_the_fence() -> None:
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("_torch/"):
            continue
        names = private_torch_names(path.read_text())
        if names:
            offenders[rel] = names
    assert not offenders, f"private torch names outside tierckpt/_torch/: {offenders}"


@pytest.mark.parametrize("source, expected", [
    ("from torch.distributed.checkpoint._nested_dict import flatten_state_dict",
     ["1: torch.distributed.checkpoint._nested_dict"]),
    ("from torch.distributed.checkpoint.filesystem import _StorageInfo",
     ["1: torch.distributed.checkpoint.filesystem._StorageInfo"]),
    ("import torch\nx = torch._C._nn.flatten_dense_tensors", ["2: torch..._nn", "2: torch..._C"]),
    ("import torch.distributed as dist\ndist.distributed_c10d._get_default_store()",
     ["2: dist..._get_default_store"]),
    ("import torch\nx = torch.zeros(1).__class__", []),
    ("from torch import nn\nclass M(nn.Module):\n    _x = 1", []),
])
def test_the_scan_finds_what_it_must(source: str, expected: list[str]) -> None:
    assert sorted(private_torch_names(source)) == sorted(expected)


def test_heal_declines_on_an_untested_torch() -> None:
    assert _torch.untested("healing", _torch.TESTED[0] + ".1+cpu") is None
    why = _torch.untested("healing", "2.99.0")
    assert why is not None and "2.99.0" in why and _torch.TESTED[0] in why
    assert _torch.release("2.13.0+cu124") == "2.13"
