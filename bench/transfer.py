"""Tier-2 upload/download against a plain boto3 transfer: the hook, not yet the measurement.

Contract for whoever fills it in (the S3 backend and ``tests/s3server.py`` are being built
alongside): ``measure_transfer(cfg, endpoint)`` gets an S3 URL on a loopback server
(``s3://bucket/prefix``; credentials and ``AWS_ENDPOINT_URL`` in the environment, as
``tests.s3server.start_server`` provides them) and returns a section with Measurement
JSON entries:

- ``boto3_upload`` / ``boto3_download``: ``client.upload_file`` / ``download_file`` of one
  file of the state's size (the limit for this section);
- ``tierckpt_upload`` / ``tierckpt_download``: the tier-2 promoter moving a committed
  checkpoint of the same state, each with ``ratio_vs_boto3`` (GB/s ÷ boto3's GB/s);
- ``throughput_uploading``: ``{"idle_steps_s", "during_steps_s", "ratio"}`` of
  ``training.Loop`` while the uploader runs.

``targets.GOALS`` already evaluates ``tierckpt_upload.ratio_vs_boto3 ≥ 0.9`` and
``throughput_uploading.ratio ≥ 0.9``; until then the section is ``{"skipped": reason}``.
"""

from __future__ import annotations

import os
from typing import Any

from bench.config import BenchConfig

ENDPOINT_ENV = "TIERCKPT_BENCH_S3_URL"


def measure_transfer(cfg: BenchConfig, endpoint: str | None = None) -> dict[str, Any]:
    """The transfer section; ``endpoint`` defaults to ``$TIERCKPT_BENCH_S3_URL``."""
    endpoint = endpoint or os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        return {"skipped": f"upload/download not measured yet: no S3 URL (set {ENDPOINT_ENV}) "
                           "and no tier-2 uploader in the bench (see bench/transfer.py)"}
    return {"skipped": f"upload/download against {endpoint} is not implemented yet "
                       "(see bench/transfer.py for the contract)"}
