"""A small YAML writer for the manifests (dicts, lists, strings, ints, bools), so the CLI
needs no YAML library. Strings that could read as another type are double-quoted (JSON
escapes, valid YAML); multi-line strings are literal blocks."""

from __future__ import annotations

import json
import re
from typing import Any

_PLAIN = re.compile(r"^[A-Za-z_/][A-Za-z0-9_./@-]*$")
_SPECIAL = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"}


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return json.dumps(v)
    if v is None:
        return "null"
    s = str(v)
    return s if _PLAIN.match(s) and s.lower() not in _SPECIAL else json.dumps(s)


def _lines(v: Any, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(v, dict):
        for k, item in v.items():
            out += _entry(f"{pad}{_scalar(k)}:", item, indent)
    elif isinstance(v, list):
        for item in v:
            sub = _lines(item, indent + 2) if isinstance(item, dict | list) and item else None
            if sub:
                out.append(f"{pad}- {sub[0].lstrip()}")
                out += sub[1:]
            else:
                out += _entry(f"{pad}-", item, indent)
    return out


def _entry(head: str, item: Any, indent: int) -> list[str]:
    if isinstance(item, dict | list) and item:
        return [head, *_lines(item, indent + 2)]
    if isinstance(item, dict):
        return [f"{head} {{}}"]
    if isinstance(item, list):
        return [f"{head} []"]
    if isinstance(item, str) and "\n" in item:
        body = [(" " * (indent + 2) + line) if line else "" for line in item.rstrip("\n")
                .split("\n")]
        return [f"{head} |", *body]
    return [f"{head} {_scalar(item)}"]


def dump(doc: Any) -> str:
    """``doc`` as YAML text (one document, ending in a newline)."""
    return "\n".join(_lines(doc, 0)) + "\n"


def dump_all(docs: list[Any]) -> str:
    """Several documents, separated by ``---``."""
    return "---\n".join(dump(d) for d in docs)
