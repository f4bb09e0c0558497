"""Build the API reference of tierckpt — every name in ``tierckpt.__all__`` — from the
docstrings with pdoc, and check it. ``make docs`` runs it into ``build/api`` (git-ignored);
tests/test_api_docs.py runs it into a temporary directory, so a broken reference fails CI.

    python docs/api/build.py [OUT]        # OUT defaults to build/api; open OUT/index.html

The reference is one page, ``tierckpt.html``: the public names in ``__all__`` order, each
with its signature (arguments and defaults) and its docstring; a config class's fields each
with their own docstring. Docstrings are reStructuredText (``:class:`...``` roles become
links).

Checks — each a problem that names what to fix; any problem fails the build (exit 1):

1. every warning pdoc raises is an error (a name in ``__all__`` that does not resolve, an
   annotation it cannot evaluate, ...);
2. every public name is on the page, with a docstring (a re-exported constant's is read
   from the module that defines it: pdoc reads only ``tierckpt/__init__.py``'s);
3. each argument of the config classes and the sampler in :data:`FIELD_DOCUMENTED` is
   documented: a dataclass field by the docstring under it, or by its name in double
   backticks in the class docstring;
4. every ``tierckpt.…`` name that a public docstring refers to (in backticks, or in a
   ``:class:``/``:func:``/``:meth:``/``:data:``/``:attr:``/``:mod:``/``:exc:`` role)
   resolves to an object.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OUT = Path("build/api")
FIELD_DOCUMENTED = ("Tier0", "Tier2", "Failures", "Preemption", "ResumableSampler")
"""Public classes whose every argument (dataclass field, or ``__init__`` parameter) must be
documented on the page."""
_REF = re.compile(r"`~?(tierckpt(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")


def build(out: Path = OUT) -> list[str]:
    """Write the reference into ``out`` (created if missing) and return the problems found
    (empty: the reference is whole). Imports tierckpt and, through its public names,
    torch."""
    import pdoc
    import pdoc.doc
    import pdoc.render

    import tierckpt

    problems: list[str] = []
    for name in tierckpt.__all__:  # resolve the lazy (PEP 562) names: pdoc reads __dict__
        try:
            getattr(tierckpt, name)
        except AttributeError as e:
            problems.append(f"tierckpt.{name} is in __all__ but does not resolve ({e})")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.render.configure(docformat="restructuredtext", search=True,
                              footer_text=f"tierckpt {tierckpt.__version__}")
        module = pdoc.doc.Module(tierckpt)
        _fill_reexported_docstrings(module)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tierckpt.html").write_text(pdoc.render.html_module(module, {"tierckpt": module}))
        (out / "index.html").write_text(pdoc.render.html_index({"tierckpt": module}))
        (out / "search.js").write_text(pdoc.render.search_index({"tierckpt": module}))
    problems += [f"pdoc: {w.category.__name__}: {w.message}" for w in caught
                 if _ours(w)]
    page = (out / "tierckpt.html").read_text()
    for name in tierckpt.__all__:
        member = module.members.get(name)
        if member is None or f'id="{name}"' not in page:
            problems.append(f"tierckpt.{name} is in __all__ but not on the page")
        elif not member.docstring.strip():
            problems.append(f"tierckpt.{name} has no docstring: write one that states its "
                            "contract")
    for name in FIELD_DOCUMENTED:
        problems += _undocumented_fields(module.members[name])
    problems += _broken_references(module)
    return problems


def _ours(w: warnings.WarningMessage) -> bool:
    """A warning about the reference (not a DeprecationWarning from an import of torch)."""
    return not issubclass(w.category, (DeprecationWarning, FutureWarning)) or \
        "pdoc" in str(w.filename)


def _fill_reexported_docstrings(module: Any) -> None:
    """A constant re-exported by ``tierckpt`` (``EXIT_PREEMPTED``, ``__version__``) gets
    the docstring written under it in its defining module."""
    import pdoc.doc

    import tierckpt

    origins = {**getattr(tierckpt, "_LAZY", {}), "__version__": "tierckpt._version"}
    for name, member in module.members.items():
        if isinstance(member, pdoc.doc.Variable) and not member.docstring and name in origins:
            source = pdoc.doc.Module(importlib.import_module(origins[name]))
            member.docstring = source._var_docstrings.get(name, "")


def _undocumented_fields(cls: Any) -> list[str]:
    obj = cls.obj
    if dataclasses.is_dataclass(obj):
        names = [f.name for f in dataclasses.fields(obj)]
    else:
        names = [p for p in inspect.signature(obj).parameters if p != "self"]
    out = []
    for field in names:
        member = cls.members.get(field)
        documented = member is not None and member.docstring.strip() and \
            member.taken_from[0].startswith("tierckpt")
        if not documented and f"``{field}``" not in cls.docstring:
            out.append(f"tierckpt.{cls.name}: argument {field!r} is not documented: add a "
                       f"docstring under the field, or name ``{field}`` in the class "
                       "docstring with its meaning, unit and default")
    return out


def _docstrings(module: Any) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) of every public name and its public members."""
    for member in module.members.values():
        yield f"tierckpt.{member.name}", member.docstring
        for sub in getattr(member, "members", {}).values():
            if not sub.name.startswith("_") and sub.taken_from[0].startswith("tierckpt"):
                yield f"tierckpt.{member.name}.{sub.name}", sub.docstring


def _broken_references(module: Any) -> list[str]:
    out = []
    for where, text in _docstrings(module):
        for ref in sorted(set(_REF.findall(text))):
            if not _resolves(ref):
                out.append(f"{where}: its docstring refers to {ref}, which does not exist")
    return out


def _resolves(dotted: str) -> bool:
    """Whether ``tierckpt.a.b.C`` names an object (a module, then attributes)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else OUT
    problems = build(out)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"API reference: {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
