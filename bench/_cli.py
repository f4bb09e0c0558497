"""The shell shared by the sections that also run alone: ``python -m bench.share``,
``bench.tier0`` and ``bench.transfer``.

:func:`run_section` parses ``--mib``, ``--repeats`` and ``--target``, measures the section in
a fresh work directory under the target (removed afterwards, whether the section returns or
raises), then prints the section's Markdown table and, after it, its JSON. No results file
is written: ``python -m bench.run`` writes those, for the whole bench. Each section's
``main`` passes only what is its own: its name, docstring, help texts, the smallest size it
can measure, and how to measure and render it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TARGET_HELP = "directory on the filesystem under test (removed afterwards)"


@dataclass(frozen=True, kw_only=True)
class SectionArgs:
    """The parsed command line: the size in MiB (what it sizes is the section's ``--mib``
    help), timed repeats, and the target directory (it exists)."""

    mib: int
    repeats: int
    target: Path


Measure = Callable[[SectionArgs, Path], dict[str, Any]]
"""``(command line, fresh work directory)`` → the section's JSON-able dict."""


def run_section(argv: list[str] | None, *, name: str, doc: str | None, mib_help: str,
                measure: Measure, markdown: Callable[[dict[str, Any]], list[str]],
                min_mib: int = 1, target_help: str = TARGET_HELP) -> int:
    """``python -m bench.<name>``: parse ``argv``, ``measure`` in a temporary directory
    ``<target>/<name>-*``, print ``markdown(section)`` and the JSON; 0. Bad arguments exit
    with argparse's status 2 (``--mib`` below ``min_mib``, ``--repeats`` below 1)."""
    ap = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help=mib_help)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--target", type=Path, default=REPO / "bench" / "out", help=target_help)
    a = ap.parse_args(argv)
    if a.mib < min_mib or a.repeats < 1:
        ap.error("--mib and --repeats must be ≥ 1" if min_mib == 1
                 else f"--mib must be ≥ {min_mib} and --repeats ≥ 1")
    a.target.mkdir(parents=True, exist_ok=True)
    args = SectionArgs(mib=a.mib, repeats=a.repeats, target=a.target)
    with tempfile.TemporaryDirectory(dir=a.target, prefix=f"{name}-") as work:
        section = measure(args, Path(work))
    print("\n".join(markdown(section)))
    print(json.dumps(section, indent=1))
    return 0
