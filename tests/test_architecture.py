"""The package layout is the architecture: the rules of ../shared/DESIGN.md ("Parts"),
checked on the code itself and held equal to docs/architecture.md.

A *part* is a folder of ``src/tierckpt`` (``tier2/``) or a module at its top
(``manager.py``). The checks:

- the layers and the allowed-dependency map below are the ones docs/architecture.md shows,
  and the page names every module;
- dependencies point inward: every ``tierckpt`` import of every module is an edge the map
  allows, no allowed edge points to an outer layer, and the part graph has no cycle;
- no part imports another part's private names (``_name``) or the package root, and no
  library module imports the CLI;
- ``format/``, ``policy/``, ``tier1/``, ``tier2/`` and the configs the CLI reads never
  import torch (the uploader process must start fast): each module is imported alone in a
  fresh interpreter;
- every exception class lives in ``errors.py``.
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tierckpt"
DOC = SRC.parents[1] / "docs" / "architecture.md"
MAP_HEADING = "## Who may import whom"
LAYERS_HEADING = "## Layers"
MODULES_HEADING = "## The parts, module by module"

TORCH_FREE = ("format", "policy", "tier1", "tier2", "launch")  # every module of these packages
TORCH_FREE_MODULES = ("tierckpt", "tierckpt.uploader", "tierckpt.config",
                      "tierckpt.save.config", "tierckpt.tier0.config",
                      "tierckpt.preempt.config", "tierckpt.preempt.notice",
                      "tierckpt.preempt.pollers", "tierckpt.runtime.scheduler",
                      "tierckpt.runtime.nodespec")

# Outermost first. A part imports only parts of its own layer or a lower one.
LAYERS = (
    ("cli/", "drill/", "uploader.py", "integrations/", "__main__.py"),       # shells
    ("__init__.py", "manager.py", "generation.py", "config.py"),              # public face
    ("ops/", "share/", "restore/", "save/", "preempt/", "launch/", "heal/"),  # paths
    ("state.py", "model_state.py", "state_capture.py", "_rng.py", "data.py",
     "tier0/", "tier2/", "tier1/"),                                            # parts
    ("runtime/",),                                                            # job runtime
    ("policy/", "format/"),                                                   # pure
    ("errors.py", "_version.py", "_runs.py", "_ports.py", "_holder.py", "_proc.py",
     "_torch/"),  # base
)

# part -> what it may import from tierckpt besides itself: ``pkg/`` is the whole package,
# ``pkg/mod.py`` that module only (where the narrow edge is the point: a torch-free part
# reaches only torch-free modules). No part may import ``__init__.py``, the package root.
ALLOWED: dict[str, tuple[str, ...]] = {
    "cli/": ("drill/", "launch/", "heal/", "ops/", "share/", "tier0/", "tier2/", "tier1/",
             "runtime/", "policy/", "format/", "errors.py", "_version.py",
             "preempt/config.py"),
    "drill/": ("config.py", "ops/", "tier0/", "tier2/", "tier1/", "runtime/", "format/",
               "errors.py", "_ports.py", "_proc.py", "_version.py", "preempt/config.py"),
    "uploader.py": ("tier2/",),
    "__main__.py": ("cli/",),
    "integrations/": ("manager.py", "config.py", "share/", "restore/", "save/", "state.py",
                      "model_state.py", "runtime/", "policy/", "format/", "errors.py"),
    "__init__.py": ("manager.py", "config.py", "share/", "restore/", "save/", "state.py",
                    "data.py", "tier0/", "tier2/", "runtime/", "policy/", "errors.py",
                    "_version.py", "preempt/"),
    "manager.py": ("generation.py", "config.py", "restore/", "save/", "state.py",
                   "tier0/", "tier2/", "tier1/", "runtime/", "policy/", "errors.py",
                   "preempt/config.py", "heal/regroup.py", "heal/survivor.py"),
    "generation.py": ("config.py", "save/", "state.py", "tier0/", "tier2/", "tier1/",
                      "runtime/", "format/", "errors.py", "preempt/"),
    "config.py": ("restore/verify.py", "save/config.py", "tier0/config.py",
                  "tier2/config.py", "policy/", "errors.py", "preempt/config.py"),
    "ops/": ("restore/verify.py", "tier0/root.py", "tier2/", "tier1/", "policy/", "format/",
             "errors.py"),
    "share/": ("restore/loader.py", "restore/metadata.py", "tier2/", "tier1/", "policy/",
               "format/", "errors.py", "_torch/dcp.py"),
    "restore/": ("save/config.py", "state.py", "tier0/", "tier2/", "tier1/", "runtime/",
                 "format/", "errors.py", "_runs.py", "_torch/dcp.py"),
    "save/": ("tier0/", "tier1/", "runtime/", "policy/", "format/", "errors.py",
              "_version.py", "_runs.py", "_torch/"),
    "preempt/": ("tier0/", "tier2/", "tier1/", "runtime/", "policy/", "format/", "errors.py"),
    "launch/": ("preempt/config.py", "runtime/events.py", "runtime/rates.py",
                "runtime/scheduler.py", "runtime/nodespec.py", "policy/", "format/",
                "errors.py", "_version.py", "_proc.py",
                "tier2/storage/url.py"),  # url.py: --tier2 checked as the library checks
    # it, and each store's credential variables (pure: no I/O, no client library)
    "heal/": ("preempt/config.py", "restore/loader.py", "state.py", "runtime/", "format/",
              "errors.py", "_torch/"),
    "state.py": ("model_state.py", "_rng.py", "data.py", "errors.py", "_torch/core.py"),
    "model_state.py": ("state_capture.py",),
    "state_capture.py": ("_torch/core.py",),
    "_rng.py": (),
    "data.py": ("errors.py",),
    "tier0/": ("tier1/", "runtime/", "policy/", "format/", "errors.py"),
    "tier2/": ("tier1/", "runtime/events.py", "runtime/deadline.py", "policy/", "format/",
               "errors.py", "_holder.py"),  # _holder: a sweep lease names its process
    "tier1/": ("policy/", "format/", "errors.py"),
    "runtime/": ("policy/", "errors.py", "_proc.py", "_torch/core.py"),
    "policy/": ("errors.py",),
    "format/": ("errors.py",),
    "errors.py": (),
    "_version.py": (),
    "_runs.py": (),
    "_ports.py": (),
    "_holder.py": ("_proc.py",),
    "_proc.py": (),
    "_torch/": ("errors.py",),
}


def _modules(package: str) -> list[str]:
    out = []
    for p in sorted((SRC / package).rglob("*.py")):
        parts = p.relative_to(SRC.parent).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def _tierckpt_imports(path: Path) -> dict[str, int]:
    """Dotted names below ``tierckpt.`` that ``path`` imports, each with the line of its first
    import: ``from tierckpt.a import b`` counts as ``a.b``, ``from tierckpt import x`` as
    ``x``, a bare ``import tierckpt`` as the root's ``__init__``. Imports inside functions
    and under ``TYPE_CHECKING`` count too."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "tierckpt":
                names = [a.name for a in node.names]
            elif node.module.startswith("tierckpt."):  # a name may be a submodule
                names = [f"{node.module.removeprefix('tierckpt.')}.{a.name}"
                         for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.removeprefix("tierckpt.") for a in node.names
                     if a.name.startswith("tierckpt.")]
            names += ["__init__" for a in node.names if a.name == "tierckpt"]  # the root
        for name in names:
            found[name] = min(found.get(name, node.lineno), node.lineno)
    return found


def _resolve(dotted: str) -> str:
    """The module or package an imported name lives in, as a path below ``src/tierckpt``
    (``tier1/fs.py``, ``tier2/storage/``), or ``__init__.py`` for a name of the root."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if SRC.joinpath(*parts[:n]).with_suffix(".py").is_file():
            return "/".join(parts[:n]) + ".py"
        if (SRC.joinpath(*parts[:n]) / "__init__.py").is_file():
            return "/".join(parts[:n]) + "/"
    return "__init__.py"


def _part(path: str) -> str:
    """``tier2/storage/s3.py`` -> ``tier2/``; ``manager.py`` -> ``manager.py``."""
    head, sep, _ = path.partition("/")
    return head + sep


@functools.cache  # parsed once per session: every parametrized check reads it
def _edges() -> tuple[tuple[str, str, str, str], ...]:
    """(importer part, imported path, ``file:line``, dotted name) for every import of one
    part by another."""
    out = []
    for p in _sources():
        rel = p.relative_to(SRC).as_posix()
        for name, line in sorted(_tierckpt_imports(p).items()):
            target = _resolve(name)
            if _part(target) != _part(rel):
                out.append((_part(rel), target, f"{rel}:{line}", name))
    return tuple(out)


def _allows(entry: str, target: str) -> bool:
    return target == entry or (entry.endswith("/") and target.startswith(entry))


def _section(heading: str) -> str:
    text = DOC.read_text()
    assert heading in text, f"docs/architecture.md lost its {heading!r} section"
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


# --- the map itself ---------------------------------------------------------------------

def test_the_map_covers_every_part() -> None:
    parts = {f"{p.name}/" for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    parts |= {p.name for p in SRC.glob("*.py")}
    layered = [p for layer in LAYERS for p in layer]
    assert sorted(layered) == sorted(set(layered)) == sorted(ALLOWED) == sorted(parts)


def test_the_map_points_inward() -> None:
    layer = {p: i for i, parts in enumerate(LAYERS) for p in parts}
    wrong = [f"{part} -> {t}" for part, targets in ALLOWED.items() for t in targets
             if not ((SRC / t).is_dir() if t.endswith("/") else (SRC / t).is_file())
             or _part(t) == part or layer[_part(t)] < layer[part]]
    assert not wrong, f"edges to a missing part, to itself or to an outer layer: {wrong}"
    assert not any("__init__.py" in targets for targets in ALLOWED.values())


def test_the_doc_shows_the_map() -> None:
    rows = re.findall(r"^\| `([^`]+)` \|(.*)\|\s*$", _section(MAP_HEADING), re.M)
    doc = {part: tuple(re.findall(r"`([^`]+)`", cell)) for part, cell in rows}
    assert list(doc) == list(ALLOWED), "the doc's map lists other parts, or in another order"
    assert {p: set(t) for p, t in doc.items()} == {p: set(t) for p, t in ALLOWED.items()}


def test_the_doc_shows_the_layers() -> None:
    block = _section(LAYERS_HEADING).split("```", 2)[1]
    doc = tuple(tuple(found) for line in block.splitlines()
                if (found := re.findall(r"\b[\w]+/|\b[\w]+\.py\b", line)))
    assert doc == LAYERS


def test_the_doc_names_every_module() -> None:
    named = re.findall(r"^\| `([^`]+\.py)` \|", _section(MODULES_HEADING), re.M)
    modules = {p.relative_to(SRC).as_posix() for p in _sources() if p.name != "__init__.py"}
    assert len(named) == len(set(named)), "a module is named twice"
    missing = sorted(modules - set(named))
    assert not missing, f"docs/architecture.md does not name {missing}"
    assert not {n for n in named if not (SRC / n).is_file()}, "the doc names a missing module"


# --- the code against the map -----------------------------------------------------------

@pytest.mark.parametrize("part", list(ALLOWED))
def test_dependencies_point_inward(part: str) -> None:
    wrong = [f"{where} {name} ({target})" for importer, target, where, name in _edges()
             if importer == part and not any(_allows(a, target) for a in ALLOWED[part])]
    assert not wrong, f"{part} may import only {list(ALLOWED[part])}: {wrong}"


def test_no_cycle_between_parts() -> None:
    graph: dict[str, dict[str, str]] = {}
    for importer, target, where, _ in _edges():
        graph.setdefault(importer, {}).setdefault(_part(target), where)
    done: set[str] = set()

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node):], node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, {})):
            if found := cycle_from(nxt, [*path, node]):
                return found
        done.add(node)
        return None

    for start in sorted(graph):
        if cyc := cycle_from(start, []):
            pytest.fail("import cycle " + " -> ".join(cyc) + ": "
                        + ", ".join(graph[a][b] for a, b in itertools.pairwise(cyc)))


def test_no_part_imports_private_names_of_another() -> None:
    # A root-level ``_name.py`` is private to the library, not to a part: the map decides
    # who may use it. Inside a part, a leading underscore keeps a name in that part.
    wrong = [f"{where} {name}" for _, _, where, name in _edges()
             if any(c.startswith("_") and not (c.startswith("__") and c.endswith("__"))
                    for c in name.split(".")[1:])]
    assert not wrong, f"private names read across parts: {wrong}"


def test_library_never_imports_the_cli() -> None:
    wrong = [where for importer, target, where, _ in _edges()
             if importer not in ("cli/", "__main__.py") and _part(target) == "cli/"]
    assert not wrong, f"library modules import the CLI: {wrong}"


@pytest.mark.parametrize("module", [m for p in TORCH_FREE for m in _modules(p)]
                         + list(TORCH_FREE_MODULES))
def test_module_imports_without_torch(module: str) -> None:
    code = (f"import sys, {module}; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
            "print(bad[:3]); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"importing {module} imported torch: {proc.stdout}{proc.stderr}"


def test_every_exception_class_lives_in_errors() -> None:
    defined = []
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception")))
                    for b in node.bases):
                defined.append(f"{p.relative_to(SRC)}:{node.name}")
    assert defined and all(d.startswith("errors.py:") for d in defined), defined


def test_a_bare_import_of_the_package_counts_as_the_root(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    import tierckpt\n    import tierckpt.tier1.fs\n")
    found = _tierckpt_imports(mod)
    assert found == {"__init__": 2, "tier1.fs": 3}
    assert _resolve("__init__") == "__init__.py"
