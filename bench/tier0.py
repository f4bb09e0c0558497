"""Tier 0 (node RAM) against tier 1 and tier 2, and against their limits, in the same run.

One process, world size 1, the bench state (``bench.state``) as a module of frozen
parameters in ``tierckpt.TrainState``. Two managers stay open side by side and their saves
interleave, so both see the same machine:

- **tier 0 on**: ``CheckpointManager(tier1=…, tier0=Tier0(<fresh mkdtemp on /dev/shm>,
  tier1_every=2))``: saves alternate RAM only (``tier == "tier0"``) and RAM then tier 1.
- **tier 0 off**: ``CheckpointManager(tier1=…)``: every save to tier 1.

The first save of each is an untimed warm-up (it allocates the staging buffers); then, best
of ``repeats``: ``C`` = seconds ``save()`` blocks; ``W`` = ``save()`` call → ``durable``
resolved (committed in RAM, or on tier 1). The background part ``W − C`` is what
``tierckpt.policy.plan`` calls W.

Restores, order rotating per repeat, each by a fresh manager into zeroed tensors, checked
against the state afterwards, and each beside its limit:

- ``tier0``: the tier-0 manager's roots; ``restore()`` reads own RAM. Limit: 2-thread
  ``copy_`` of the state into existing buffers (``limits.copy_limit``, memcpy).
- ``tier1``: the tier-0-off root, its files evicted from the page cache first
  (``pagecache.evict``; ``cold`` says whether it worked). Limit: sequential cold read of a
  file of the same size (``limits.cold_read_limit``).
- ``tier2``: an empty tier-1 root, no tier 0, ``tier2=`` the tier-0-off root's checkpoint as
  uploaded by ``tierckpt.tier2.uploader``. Limit: boto3's transfer manager downloading the
  same objects to files on the same filesystem (no verify, no fsync); with a ``file://``
  tier 2, ``shutil.copyfile`` of the same files.

Tier 2 is ``$TIERCKPT_BENCH_S3_URL`` (a fresh prefix under it, removed afterwards), else a
SeaweedFS on loopback (``bench.transfer.tier2``), else — no ``weed`` binary — a ``file://``
directory under the work directory (``server`` says which).

Every restore's ``source`` and ``bytes_by_source`` come from its ``RestoreInfo``. ``restart``
is a fresh ``python -c "import torch, tierckpt"`` (what a restarted worker pays before
``CheckpointManager()``); the plan's R is restart + manager open + ``restore()``, a lower
bound of a real restart (no scheduler, no rendezvous, no CUDA init). The plan feeds C,
W − C and R into ``tierckpt.policy.plan.plan_interval`` for the demo's cluster (64 nodes,
node MTBF 32 days), assuming every failure restores from the node's own RAM (tier 0) or
from tier 1. Training throughput during tier-0 replication needs two nodes and is not
measured here. Rates are decimal GB/s; ratios are GB/s ÷ the limit's GB/s.

``python -m bench.tier0 [--mib 1024] [--repeats 2]`` prints the table and the JSON.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from bench._cli import run_section
from bench.limits import measure_limits
from bench.measure import best_of
from bench.pagecache import evict, files_under
from bench.state import StateModule, build_state, empty_like_state, make_specs, state_bytes
from bench.transfer import ENDPOINT_ENV, content_keys, remove_remote, weed_missing
from bench.transfer import tier2 as transfer_tier2
from tierckpt import CheckpointManager, Tier0, Tier2, TrainState
from tierckpt.cli.demo import CLUSTER_NODES, NODE_MTBF_S
from tierckpt.policy import plan as planlib
from tierckpt.tier1.catalog import Tier1Catalog
from tierckpt.tier2.storage.url import parse_url
from tierckpt.tier2.uploader import Uploader, UploaderConfig

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
SHM = Path("/dev/shm")
SHM_PREFIX = "tierckpt-bench-tier0-"
"""Name prefix of the bench's tier-0 directory on /dev/shm (removed at the end)."""
TIER1_EVERY = 2
_RESTART = "import torch, tierckpt"
SOURCES = ("tier0", "tier1", "tier2")


def _ts(state: dict[str, torch.Tensor]) -> TrainState:
    return TrainState(model=StateModule(state))


def _m(runs: list[float], nbytes: int, **extra: Any) -> dict[str, Any]:
    return best_of(runs, nbytes, **extra).to_json()


# ----------------------------------------------------------------------------- tier 2


@contextlib.contextmanager
def tier2(work: Path, url: str | None = None) -> Iterator[tuple[str, str]]:
    """``(url, server)``: ``url``/``$TIERCKPT_BENCH_S3_URL`` (``given``) or a loopback
    SeaweedFS (``seaweedfs``), per :func:`bench.transfer.tier2` with the prefix
    ``bench-tier0``; without a ``weed`` binary, a ``file://`` directory under ``work``
    (``file (…why)``)."""
    missing = None if url or os.environ.get(ENDPOINT_ENV) else weed_missing()
    if missing is None:
        with transfer_tier2(work, url, "tier0") as (remote, server):
            yield remote, server
        return
    root = work.absolute() / "tier2-file"
    root.mkdir(parents=True, exist_ok=True)
    yield f"file://{root}", f"file ({missing})"


def _upload(root: Path, url: str) -> dict[str, Any]:
    with Uploader(UploaderConfig(tier1=root, tier2=url, keep_last=1)) as up:
        results = up.drain()
    if not results or any(r.status != "verified" for r in results):
        raise RuntimeError(f"upload of {root} to {url} did not verify: {results}")
    r = results[-1]
    return {"seconds": r.seconds, "bytes": r.bytes,
            "gbps": r.bytes / r.seconds / 1e9 if r.seconds > 0 else 0.0}


def _plain_download(url: str, members: dict[str, int], step: int, dest: Path) -> Callable[[],
                                                                                      float]:
    """The tier-2 limit: seconds to fetch ``members`` of ``step`` into files under ``dest``
    with plain boto3 (s3://) or ``shutil.copyfile`` (file://); nothing verified or synced."""
    u = parse_url(url)
    key = content_keys(url, step)  # each member's object, through the step's map
    if u.scheme == "file":

        def fetch(name: str, path: Path) -> None:
            shutil.copyfile(Path(u.location) / key(name), path)
    else:
        from bench import tier2_servers as t2  # lazy: importing it puts tests/ on sys.path

        client, tcfg = t2._boto3(os.environ.get("AWS_ENDPOINT_URL"))  # type: ignore[arg-type]

        def fetch(name: str, path: Path) -> None:
            client.download_file(u.location, key(name), str(path), Config=tcfg)

    def run() -> float:
        dest.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        for name in members:
            fetch(name, dest / name.replace("/", "_"))
        seconds = time.perf_counter() - t0
        shutil.rmtree(dest)
        return seconds
    return run


# ----------------------------------------------------------------------------- saves


def _save(ck: CheckpointManager, step: int, ts: TrainState, want: str,
          runs: dict[str, list[float]]) -> None:
    t0 = time.perf_counter()
    handle = ck.save(step, ts)
    blocking = time.perf_counter() - t0
    result = handle.wait()
    durable = time.perf_counter() - t0
    if result.tier != want:
        raise AssertionError(f"save of step {step} landed on {result.tier}, expected {want}")
    runs["blocking"].append(blocking)
    runs["durable"].append(durable)
    runs["background"].append(durable - blocking)


def _save_summary(runs: dict[str, list[float]], nbytes: int, tier: str,
                  note: str) -> dict[str, Any]:
    return {"tier": tier, "note": note,
            **{k: _m(v, nbytes) for k, v in runs.items()}}


def _measure_saves(on: CheckpointManager, off: CheckpointManager, ts: TrainState,
                   nbytes: int, repeats: int) -> tuple[dict[str, Any], int]:
    """Interleaved timed saves on both managers; the summaries and the newest step."""
    def fresh() -> dict[str, list[float]]:
        return {"blocking": [], "durable": [], "background": []}

    _save(on, 0, ts, "tier1", fresh())  # warm-ups: they allocate the staging buffers
    _save(off, 0, ts, "tier1", fresh())
    runs = {k: fresh() for k in ("tier0_ram", "tier0_tier1", "tier0_off")}
    for r in range(repeats):
        pair = [(on, 2 * r + 1, "tier0", "tier0_ram"), (on, 2 * r + 2, "tier1", "tier0_tier1")]
        single = [(off, r + 1, "tier1", "tier0_off")]
        for ck, step, tier, kind in pair + single if r % 2 == 0 else single + pair:
            _save(ck, step, ts, tier, runs[kind])  # the pair keeps its order: steps increase
    return {"tier0_ram": _save_summary(runs["tier0_ram"], nbytes, "tier0",
                                       "tier 0 on, a RAM-only save: save() → committed in RAM"),
            "tier0_tier1": _save_summary(runs["tier0_tier1"], nbytes, "tier1",
                                         f"tier 0 on, every {TIER1_EVERY}nd save: RAM, then "
                                         "copied to tier 1 (durable = committed on tier 1)"),
            "tier0_off": _save_summary(runs["tier0_off"], nbytes, "tier1",
                                       "tier 0 off: save() → committed on tier 1")}, 2 * repeats


# ----------------------------------------------------------------------------- restores


class _Restores:
    """The three restores and their references, each callable once per repeat."""

    def __init__(self, state: dict[str, torch.Tensor], work: Path, roots: dict[str, Path],
                 tier0_dir: Path, url: str) -> None:
        self.state, self.work, self.roots = state, work, roots
        self.tier0_dir, self.url = tier0_dir, url
        self.target = empty_like_state(state)
        self.ts = _ts(self.target)
        self.runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SOURCES}

    def _restore(self, name: str, **kwargs: Any) -> None:
        for t in self.target.values():
            t.zero_()
        t0 = time.perf_counter()
        with CheckpointManager(keep_last=1, **kwargs) as ck:
            opened = time.perf_counter()
            info = ck.restore(self.ts)
            done = time.perf_counter()
        if info is None:
            raise AssertionError(f"{name} restore found no checkpoint ({kwargs})")
        for key, want in self.state.items():
            if not torch.equal(want, self.target[key]):
                raise AssertionError(f"{name} restore put wrong values into {key}")
        self.runs[name].append({"seconds": done - opened, "open_seconds": opened - t0,
                                "source": info.source, "info_seconds": info.seconds,
                                "bytes_read": info.bytes_read,
                                "bytes_by_source": dict(info.bytes_by_source)})

    def tier0(self) -> None:
        self._restore("tier0", tier1=self.roots["tier0_on"],
                      tier0=Tier0(self.tier0_dir, tier1_every=TIER1_EVERY, keep_on_close=True))

    def tier1(self) -> None:
        root = self.roots["tier0_off"]
        ev = evict(files_under(root)).to_json()
        self._restore("tier1", tier1=root)
        self.runs["tier1"][-1]["eviction"] = ev

    def tier2(self) -> None:
        root = self.work / f"tier1-empty-{len(self.runs['tier2'])}"
        try:
            self._restore("tier2", tier1=root, tier2=Tier2(self.url, start_uploader=False))
        finally:
            shutil.rmtree(root, ignore_errors=True)


def _restore_summary(runs: list[dict[str, Any]], nbytes: int, limit: dict[str, Any],
                     limit_name: str) -> dict[str, Any]:
    out = _m([r["seconds"] for r in runs], nbytes, limit=limit_name,
             source=runs[-1]["source"], sources=sorted({r["source"] for r in runs}),
             bytes_by_source=runs[-1]["bytes_by_source"], bytes_read=runs[-1]["bytes_read"],
             info_seconds=min(r["info_seconds"] for r in runs),
             open_seconds=min(r["open_seconds"] for r in runs))
    out["ratio_vs_limit"] = out["gbps"] / limit["gbps"] if limit.get("gbps") else None
    if "eviction" in runs[-1]:
        out["evictions"] = [r["eviction"] for r in runs]
        out["cold"] = all(r["eviction"]["honoured"] for r in runs)
    return out


def _restart(repeats: int) -> dict[str, Any]:
    runs = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", _RESTART], cwd=REPO, env=env, check=True,
                       timeout=300)
        runs.append(time.perf_counter() - t0)
    return _m(runs, 0, note=f"fresh `python -c \"{_RESTART}\"`")


# ----------------------------------------------------------------------------- plan


def _plans(saves: dict[str, Any], restores: dict[str, Any],
           restart_s: float) -> dict[str, Any]:
    """Young's interval and its waste for tier 0 vs tier 1 from the measured C, W − C, R."""
    M = planlib.job_mtbf(NODE_MTBF_S, CLUSTER_NODES)
    out: dict[str, Any] = {"nodes": CLUSTER_NODES, "node_mtbf_s": NODE_MTBF_S, "job_mtbf_s": M,
                           "R": "process restart + CheckpointManager() + restore()"}
    for name, save, restore in (("tier0", "tier0_ram", "tier0"), ("tier1", "tier0_off", "tier1")):
        C, W = saves[save]["blocking"]["seconds"], saves[save]["background"]["seconds"]
        R = restart_s + restores[restore]["open_seconds"] + restores[restore]["seconds"]
        p = planlib.plan_interval(C, M, R, W=W, name=name)
        out[name] = {"C_s": C, "W_s": W, "R_s": R, "interval_s": p.interval_s,
                     "waste": p.waste.total, "waste_ckpt": p.waste.ckpt,
                     "waste_rework": p.waste.rework, "waste_restart": p.waste.restart,
                     "exact_waste": p.exact_waste_fraction, "overlap": p.overlap}
    out["waste_tier0_vs_tier1"] = out["tier0"]["waste"] / out["tier1"]["waste"]
    return out


# ----------------------------------------------------------------------------- section


def _managers(roots: dict[str, Path], tier0_dir: Path) -> tuple[CheckpointManager,
                                                                 CheckpointManager]:
    on = CheckpointManager(tier1=roots["tier0_on"],
                           tier0=Tier0(tier0_dir, tier1_every=TIER1_EVERY, keep=1,
                                       keep_on_close=True), keep_last=1)
    try:
        return on, CheckpointManager(tier1=roots["tier0_off"], keep_last=1)
    except BaseException:
        on.close(after_error=True)
        raise


def _restore_all(r: _Restores, plain: Callable[[], float], repeats: int) -> list[float]:
    ops: list[Callable[[], Any]] = [r.tier0, r.tier1, r.tier2]
    plain_runs: list[float] = []
    ops.append(lambda: plain_runs.append(plain()))
    for i in range(repeats):
        for op in ops[i % len(ops):] + ops[:i % len(ops)]:
            op()
    return plain_runs


def _measure(work: Path, tier0_dir: Path, url: str, total_bytes: int,
             repeats: int) -> dict[str, Any]:
    state = build_state(make_specs(total_bytes))
    nbytes, ts = state_bytes(state), _ts(state)
    measured, _ = measure_limits(work, state, repeats)
    limits = {k: measured[k].to_json() for k in ("copy_2threads", "cold_read",
                                                  "write_odirect_fsync")}
    roots = {k: work / k for k in ("tier0_on", "tier0_off")}
    on, off = _managers(roots, tier0_dir)
    with on, off:
        saves, newest = _measure_saves(on, off, ts, nbytes, repeats)
    upload = _upload(roots["tier0_off"], url)
    step = repeats  # the tier-0-off root's newest, the one uploaded
    committed = Tier1Catalog(roots["tier0_off"]).read_committed(step)
    members = {f.name: f.size for f in committed.manifest.files}
    ckpt_bytes = committed.manifest.total_bytes
    rs = _Restores(state, work, roots, tier0_dir, url)
    plain = _restore_all(rs, _plain_download(url, members, step, work / "plain-download"),
                         repeats)
    limits["plain_download"] = _m(plain, sum(members.values()), objects=len(members))
    restores = {
        "tier0": _restore_summary(rs.runs["tier0"], ckpt_bytes, limits["copy_2threads"],
                                  "copy_2threads"),
        "tier1": _restore_summary(rs.runs["tier1"], ckpt_bytes, limits["cold_read"],
                                  "cold_read"),
        "tier2": _restore_summary(rs.runs["tier2"], ckpt_bytes, limits["plain_download"],
                                  "plain_download")}
    restart = _restart(repeats)
    return {"bytes": nbytes, "checkpoint_bytes": ckpt_bytes, "newest_tier0_step": newest,
            "limits": limits, "saves": saves, "upload": upload, "restores": restores,
            "restart": restart,
            "C_tier0_vs_off": saves["tier0_ram"]["blocking"]["seconds"]
            / saves["tier0_off"]["blocking"]["seconds"],
            "W_ram_vs_tier1": saves["tier0_ram"]["durable"]["seconds"]
            / saves["tier0_off"]["durable"]["seconds"],
            "plan": _plans(saves, restores, restart["seconds"])}


def measure_tier0(work: Path, total_bytes: int, *, url: str | None = None,
                  repeats: int = 2) -> dict[str, Any]:
    """The section: a state of about ``total_bytes``, tier-1 roots under ``work`` (created;
    the caller removes it), tier 0 in a fresh directory on /dev/shm (removed before this
    returns), tier 2 per :func:`tier2` (its prefix emptied). JSON-able."""
    work = work.absolute()
    work.mkdir(parents=True, exist_ok=True)
    tier0_dir = Path(tempfile.mkdtemp(dir=SHM, prefix=SHM_PREFIX))
    try:
        with tier2(work, url) as (remote, server):
            try:
                out = _measure(work, tier0_dir, remote, total_bytes, repeats)
            finally:
                remove_remote(remote, "tier0")
    finally:
        shutil.rmtree(tier0_dir, ignore_errors=True)
    notes = ["Training throughput while tier 0 replicates to a partner node needs two "
             "nodes: not measured here.",
             "R = fresh `python -c \"import torch, tierckpt\"` + CheckpointManager() + "
             "restore(): a lower bound (no scheduler, rendezvous or CUDA init).",
             "The tier-0 plan assumes every failure restores from the node's own RAM; a lost "
             "node restores from its partner's RAM or tier 1 instead."]
    return {"server": server, "tier2_url": remote, "tier0_dir": str(tier0_dir),
            "tier1_every": TIER1_EVERY, "repeats": repeats, **out, "notes": notes}


def _row(label: str, m: dict[str, Any], vs: str = "", note: str = "") -> str:
    return f"| {label} | {m['seconds']:.3g} | {m['gbps']:.3g} | {vs} | {note} |"


def _src(r: dict[str, Any]) -> str:
    by = ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in r["bytes_by_source"].items() if v)
    return f"source `{r['source']}` ({by})"


def markdown(s: dict[str, Any]) -> list[str]:
    """The section as Markdown lines: restores, saves, the plan, notes."""
    lines = ["## Tier 0: node RAM vs tier 1 vs tier 2 (same run)", ""]
    if "skipped" in s:
        return [*lines, f"**Skipped:** {s['skipped']}", ""]
    lim, rs, sv, p = s["limits"], s["restores"], s["saves"], s["plan"]
    t1 = rs["tier1"]
    cold = "" if t1.get("cold", True) else " **not cold**"
    lines += [
        "| measurement | seconds | GB/s | vs limit | note |", "|---|---|---|---|---|",
        _row("restore() from tier 0 (own RAM)", rs["tier0"],
             f"{rs['tier0']['ratio_vs_limit']:.2f}× memcpy", _src(rs["tier0"])),
        _row("memcpy: 2-thread `copy_` into existing buffers", lim["copy_2threads"],
             "limit"),
        _row("restore() from tier 1, page cache dropped", t1,
             f"{t1['ratio_vs_limit']:.2f}× cold read", _src(t1) + cold),
        _row("sequential cold read, same bytes", lim["cold_read"], "limit"),
        _row(f"restore() from tier 2 ({s['server']}), tier 0 and 1 empty", rs["tier2"],
             f"{rs['tier2']['ratio_vs_limit']:.2f}× plain download", _src(rs["tier2"])),
        _row("plain download of the same objects to files", lim["plain_download"], "limit",
             f"{lim['plain_download']['objects']} objects, unverified, no fsync"),
        _row("C: save() blocking, tier 0 on (RAM-only save)", sv["tier0_ram"]["blocking"],
             f"{s['C_tier0_vs_off']:.2f}× tier 0 off"),
        _row("C: save() blocking, tier 0 off", sv["tier0_off"]["blocking"]),
        _row("W: save() → committed in RAM (tier 0)", sv["tier0_ram"]["durable"],
             f"{s['W_ram_vs_tier1']:.2f}× tier-1 save",
             f"{sv['tier0_ram']['durable']['seconds'] / lim['copy_2threads']['seconds']:.1f}"
             "× the memcpy's seconds"),
        _row(f"W: tier 0 on, every {TIER1_EVERY}nd save → committed on tier 1",
             sv["tier0_tier1"]["durable"]),
        _row("W: save() → committed on tier 1 (tier 0 off)", sv["tier0_off"]["durable"],
             f"{sv['tier0_off']['durable']['gbps'] / lim['write_odirect_fsync']['gbps']:.2f}× "
             "O_DIRECT write" if lim["write_odirect_fsync"].get("gbps") else ""),
        f"| process restart (`python -c \"import torch, tierckpt\"`) | "
        f"{s['restart']['seconds']:.3g} | | | part of R |", "",
        f"Plan (`tierckpt.policy.plan.plan_interval`, Young) for {p['nodes']} nodes × node "
        f"MTBF {p['node_mtbf_s'] / 86400:.0f} d (job MTBF {p['job_mtbf_s'] / 3600:.1f} h); "
        f"W = background seconds (W − C above); R = {p['R']}:", "",
        "| plan | C s | W s | R s | interval s | expected waste | exact waste |",
        "|---|---|---|---|---|---|---|"]
    for name in ("tier0", "tier1"):
        q = p[name]
        lines.append(f"| {name} | {q['C_s']:.3g} | {q['W_s']:.3g} | {q['R_s']:.3g} | "
                     f"{q['interval_s']:.0f} | {q['waste']:.3%} | {q['exact_waste']:.3%} |")
    lines += ["", f"State {s['bytes'] / MiB:.0f} MiB (world 1), best of {s['repeats']}; tier 2 "
              f"on {s['server']}. " + " ".join(s["notes"]), ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.tier0``: run the section alone; print its table and JSON."""
    return run_section(
        argv, name="tier0", doc=__doc__, mib_help="state size in MiB", markdown=markdown,
        target_help="directory on the tier-1 filesystem under test (removed afterwards)",
        measure=lambda a, work: measure_tier0(work, a.mib * MiB, repeats=a.repeats))


if __name__ == "__main__":
    sys.exit(main())
