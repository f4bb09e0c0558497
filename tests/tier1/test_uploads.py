"""tier1.uploads: the upload ledger (the job's asks of tier 2, the uploader's records)."""

from __future__ import annotations

from pathlib import Path

from tierckpt.tier1.catalog import Tier1Catalog


def test_upload_records(tmp_path: Path) -> None:
    ledger = Tier1Catalog(tmp_path).uploads
    assert not ledger.has_upload_records() and ledger.upload_records() == {}
    ledger.write_upload_record(3, status="verified", save_id="a")
    ledger.write_upload_record(4, status="failed", error="boom")
    (ledger.upload_state_dir() / "step-00000009.json").write_text("{not json")
    assert ledger.has_upload_records()
    rec = ledger.upload_record(4)
    assert rec is not None and rec["error"] == "boom"
    assert ledger.upload_record(9) is None and set(ledger.upload_records()) == {3, 4}
    assert ledger.uploaded_steps() == {3}
