"""A run on Google Cloud Storage (its emulator, fake-gcs-server): train and save with a
``gs://`` tier 2, lose the node (tier 1 wiped), resume from tier 2 alone — the losses after
the resume are bit-identical to an uninterrupted run's. The whole job path: the probe,
the uploader process (which finds the emulator through ``STORAGE_EMULATOR_HOST``), the
drain on close, the fetch verified against the manifest."""

from __future__ import annotations

from pathlib import Path

from gcsserver import GCSEnv

from tests._tinyjob import resume_from_tier2_alone
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import open_storage


def test_resume_from_gcs_alone_is_bit_identical(tmp_path: Path, gcs_env: GCSEnv) -> None:
    root = tmp_path / "t1"

    def uploaded() -> None:
        record = Tier1Catalog(root).uploads.upload_record(4)
        # the probe's mode reached the job's uploader: the emulator ignores declared checksums
        assert record is not None and record["integrity"] == "md5"
        with open_storage(gcs_env.url) as remote:
            assert Tier2Catalog(remote).complete_steps() == [4]
        assert not [n for n in gcs_env.names() if ".tierckpt-tmp." in n]

    resume_from_tier2_alone(root, gcs_env.url, saved=4, end=10, uploaded=uploaded)
