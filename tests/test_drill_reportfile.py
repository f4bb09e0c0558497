"""The report files every drill writes (tierckpt.drill.reportfile): names, order, what the
JSON records, and the Markdown as rendered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tierckpt.drill.reportfile import write_report_files


def _render(doc: dict[str, Any]) -> str:
    return f"# {doc['title']}\n"


def test_writes_json_and_markdown_and_records_the_paths_in_the_json(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"  # created, parents too
    doc: dict[str, Any] = {"title": "t", "where": Path("/x")}
    files = write_report_files(doc, out, "x-report", _render,
                               also={"png": str(out / "x-timeline.png")})
    assert list(files) == ["json", "md", "png"]
    assert files["json"] == str(out / "x-report.json") and files["md"] == str(out / "x-report.md")
    assert doc["files"] == files
    text = (out / "x-report.json").read_text()
    assert text.endswith("}\n") and text == json.dumps(doc, indent=2, default=str) + "\n"
    assert json.loads(text)["where"] == "/x" and json.loads(text)["files"] == files
    assert (out / "x-report.md").read_text() == "# t\n"
    assert not (out / "x-timeline.png").exists()  # the caller writes what it names in also


def test_without_record_the_document_is_left_as_it_was(tmp_path: Path) -> None:
    doc: dict[str, Any] = {"title": "h"}
    files = write_report_files(doc, tmp_path, "heal-report", _render, record=False)
    assert doc == {"title": "h"} and list(files) == ["json", "md"]
    assert json.loads((tmp_path / "heal-report.json").read_text()) == {"title": "h"}
    assert (tmp_path / "heal-report.md").read_text() == "# h\n"
