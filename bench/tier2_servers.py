"""Tier-2 transfer on each test server, next to plain boto3 in the same run.

``python -m bench.tier2_servers [--mib 256] [--rounds 3]`` starts SeaweedFS and moto's S3
server on loopback (tests/s3server.py), probes each (the mode tierckpt picks), then times,
alternating the order each round: ``S3Storage.put_file``/``get_file`` of one file (verified
end to end in the server's mode) and boto3's ``upload_file``/``download_file`` of the same
bytes with the same part size and concurrency. Prints a table and writes
``bench/results/tier2-servers-<time>.json``. Medians; ratios are tierckpt ÷ boto3 (higher is
better).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from s3server import BUCKET, start_moto, start_server, stop_server  # noqa: E402

from tierckpt.format import checksum  # noqa: E402
from tierckpt.tier2.probe import probe_url  # noqa: E402
from tierckpt.tier2.storage import open_storage  # noqa: E402

MiB = 1024 * 1024
PART = 16 * MiB
CONCURRENCY = 8


def _boto3(endpoint: str) -> Any:
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint, config=Config(
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required", max_pool_connections=16))
    return client, TransferConfig(multipart_threshold=PART, multipart_chunksize=PART,
                                  max_concurrency=CONCURRENCY)


def _time(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(kind: str, env: dict[str, str], src: Path, rounds: int) -> dict[str, Any]:
    os.environ.update(env)
    url = f"s3://{BUCKET}/bench-{kind}"
    result = probe_url(url)
    opts = {**result.s3_options(), "part_size": PART, "multipart_threshold": PART,
            "max_concurrency": CONCURRENCY}
    crc, size = checksum.of_file(src)
    client, tcfg = _boto3(env["AWS_ENDPOINT_URL"])
    times: dict[str, list[float]] = {k: [] for k in ("tierckpt_up", "boto3_up", "tierckpt_down",
                                                     "boto3_down")}
    with open_storage(url, **opts) as st, tempfile.TemporaryDirectory() as tmp:
        dl = Path(tmp) / "dl"
        for r in range(rounds):
            ops = [("tierckpt_up", lambda: st.put_file("obj-t", src, crc32c=crc, size=size)),
                   ("boto3_up", lambda: client.upload_file(str(src), BUCKET,
                                                           f"bench-{kind}/obj-b", Config=tcfg))]
            for name, fn in (ops if r % 2 == 0 else ops[::-1]):
                times[name].append(_time(fn))
            ops = [("tierckpt_down", lambda: st.get_file("obj-t", dl, crc32c=crc)),
                   ("boto3_down", lambda: client.download_file(BUCKET, f"bench-{kind}/obj-b",
                                                               str(dl), Config=tcfg))]
            for name, fn in (ops if r % 2 == 0 else ops[::-1]):
                times[name].append(_time(fn))
                dl.unlink(missing_ok=True)
    mibs = {k: size / MiB / statistics.median(v) for k, v in times.items()}
    return {"server": kind, "integrity": result.modes.integrity.value
            if result.modes.integrity else None, "marker": result.modes.marker.value,
            "mib": size / MiB, "MiB_s": mibs,
            "upload_ratio_vs_boto3": mibs["tierckpt_up"] / mibs["boto3_up"],
            "download_ratio_vs_boto3": mibs["tierckpt_down"] / mibs["boto3_down"]}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.tier2_servers")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as base:
        src = Path(base) / "src"
        with open(src, "wb") as f:
            for _ in range(a.mib):
                f.write(os.urandom(MiB))
        for kind, start in (("seaweedfs", start_server), ("moto", start_moto)):
            d = Path(base) / kind
            d.mkdir()
            proc, server = start(d)
            try:
                rows.append(measure(kind, server.env(), src, a.rounds))
            finally:
                stop_server(proc, server.ports)
    print(f"{'server':<10} {'mode':<7} {'up MiB/s':>9} {'boto3':>7} {'ratio':>6} "
          f"{'down MiB/s':>10} {'boto3':>7} {'ratio':>6}")
    for r in rows:
        m = r["MiB_s"]
        print(f"{r['server']:<10} {r['integrity']:<7} {m['tierckpt_up']:>9.0f} "
              f"{m['boto3_up']:>7.0f} {r['upload_ratio_vs_boto3']:>6.2f} "
              f"{m['tierckpt_down']:>10.0f} {m['boto3_down']:>7.0f} "
              f"{r['download_ratio_vs_boto3']:>6.2f}")
    out = REPO / "bench" / "results" / time.strftime("tier2-servers-%Y-%m-%dT%H%M%SZ.json",
                                                     time.gmtime())
    out.write_text(json.dumps({"mib": a.mib, "rounds": a.rounds, "rows": rows}, indent=1))
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
