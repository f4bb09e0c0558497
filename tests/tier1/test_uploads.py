"""tier1.uploads: the upload ledger (the job's asks of tier 2, the uploader's records)."""

from __future__ import annotations

from pathlib import Path

from tests._synthetic import make_checkpoint
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


def test_a_record_of_an_earlier_save_of_the_step_is_not_uploaded(tmp_path: Path) -> None:
    """Step 5 was uploaded, rolled back (a heal or a restart) and saved again: its record
    names the earlier save, so the new checkpoint counts as not uploaded (tier-1 retention
    keeps it, the uploader copies it) until a record names its own save."""
    catalog = Tier1Catalog(tmp_path)
    ledger = catalog.uploads
    first = make_checkpoint(tmp_path, 5, {"__0_0.distcp": (100, 0)})
    ledger.write_upload_record(5, status="verified", save_id=first.save_id)
    assert ledger.uploaded_steps() == {5}
    catalog.delete(5)
    again = make_checkpoint(tmp_path, 5, {"__0_0.distcp": (100, 0)}, seed=1)
    assert again.save_id != first.save_id and ledger.uploaded_steps() == set()
    ledger.write_upload_record(5, status="verified", save_id=again.save_id)
    assert ledger.uploaded_steps() == {5}
    ledger.write_upload_record(5, status="verified")  # a record without a save id stands
    assert ledger.uploaded_steps() == {5}
