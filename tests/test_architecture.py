"""The package layout is the architecture: the rules of ../shared/DESIGN.md ("Parts"),
checked on the code itself.

- ``format/``, ``policy/``, ``tier1/`` and ``tier2/`` never import torch (the uploader
  process must start fast): each module is imported alone in a fresh interpreter;
- dependencies point inward: each of those packages imports only the packages below it;
- no library module imports the CLI (the CLI depends on the library, never the reverse).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tierckpt"
TORCH_FREE = ("format", "policy", "tier1", "tier2")
ALLOWED = {  # package -> what it may import from tierckpt (besides itself)
    "format": {"errors"},
    "policy": {"errors", "format"},
    "tier1": {"errors", "format", "policy"},
    "tier2": {"errors", "format", "policy", "tier1", "runtime.events"},
}


def _modules(package: str) -> list[str]:
    out = []
    for p in sorted((SRC / package).rglob("*.py")):
        parts = p.relative_to(SRC.parent).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _tierckpt_imports(path: Path) -> set[str]:
    """Dotted names below ``tierckpt.`` that ``path`` imports: ``from tierckpt.a import b``
    counts as ``a.b``, ``from tierckpt import x`` as ``x``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "tierckpt":
                found |= {a.name for a in node.names}
            elif node.module.startswith("tierckpt."):  # a name may be a submodule
                found |= {f"{node.module.removeprefix('tierckpt.')}.{a.name}"
                          for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("tierckpt.") for a in node.names
                      if a.name.startswith("tierckpt.")}
    return found


@pytest.mark.parametrize("module", [m for p in TORCH_FREE for m in _modules(p)]
                         + ["tierckpt.uploader"])
def test_module_imports_without_torch(module: str) -> None:
    code = (f"import sys, {module}; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
            "print(bad[:3]); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"importing {module} imported torch: {proc.stdout}{proc.stderr}"


def test_the_checks_cover_every_package() -> None:
    assert len(_modules("tier2")) > 10 and "tierckpt.tier1.catalog" in _modules("tier1")


@pytest.mark.parametrize("package", TORCH_FREE)
def test_dependencies_point_inward(package: str) -> None:
    allowed = ALLOWED[package] | {package}
    wrong = {}
    for p in sorted((SRC / package).rglob("*.py")):
        bad = {name for name in _tierckpt_imports(p)
               if not any(name == a or name.startswith(a + ".") for a in allowed)}
        if bad:
            wrong[str(p.relative_to(SRC))] = sorted(bad)
    assert not wrong, f"{package}/ may import only {sorted(allowed)}: {wrong}"


def test_library_never_imports_the_cli() -> None:
    offenders = [str(p.relative_to(SRC)) for p in sorted(SRC.rglob("*.py"))
                 if p.relative_to(SRC).parts[0] != "cli"
                 and any(n == "cli" or n.startswith("cli.") for n in _tierckpt_imports(p))]
    assert offenders == []


def test_every_exception_class_lives_in_errors() -> None:
    defined = []
    for p in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception")))
                    for b in node.bases):
                defined.append(f"{p.relative_to(SRC)}:{node.name}")
    assert defined and all(d.startswith("errors.py:") for d in defined), defined
