"""The run users care about, on Azure Blob Storage (Azurite): train and save with an az://
tier 2, wipe tier 1 (the node is gone), resume from tier 2 alone — bit-identical losses.
The S3 twin is tests/test_tier2_servers.py."""

from __future__ import annotations

from pathlib import Path

from azureserver import AzureEnv

from tests._tinyjob import resume_from_tier2_alone
from tierckpt.tier1.catalog import Tier1Catalog


def test_resume_from_azure_tier2_only(tmp_path: Path, azure_env: AzureEnv) -> None:
    """Through the whole job: the probe (md5 integrity, create-only marker), the uploader
    process finding the emulator through AZURE_STORAGE_CONNECTION_STRING, the drain on
    close, the fetch from tier 2 verified against the manifest."""
    root = tmp_path / "t1"

    def uploaded() -> None:
        assert Tier1Catalog(root).uploads.upload_record(4)["integrity"] == "md5"  # type: ignore[index]
        assert azure_env.keys().count("step-00000004/COMPLETE") == 1  # the marker, once

    resume_from_tier2_alone(root, azure_env.url, saved=4, end=10, uploaded=uploaded)
