"""Heals across nodes for real (issue 43): simulated nodes on this machine, one
``tierckpt run --heal --nnodes`` supervisor each (its own session, so that losing the node
is ``killpg`` of its supervisor and workers), the job's store in etcd
(``tests/etcdserver.py``), examples/train.py on gloo. A node lost mid-run is replaced by a
spare node while the other nodes keep their processes, and the losses equal an
uninterrupted run's bit for bit; with no spare node the job restarts in full and still
resumes exactly."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.etcdserver import EtcdCluster, job_id
from tests.heal.test_heal_jobs import (
    EXAMPLE,
    SMALL,
    TIMEOUT_S,
    _env,
    _events,
    _losses,
    processes,
    reference,
    same_losses,
)
from tierckpt.errors import ConfigError
from tierckpt.heal.launcher import HealLaunch
from tierckpt.heal.nodes import NodeLaunch
from tierckpt.runtime import events as ev
from tierckpt.runtime.etcdstore import EtcdStore
from tierckpt.runtime.nodespec import parse_endpoint, parse_nnodes
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import LocalStorage

DETECT_S = 2.0


class Node:
    """One simulated node: a supervisor (session leader) and its workers."""

    def __init__(self, tmp: Path, name: str, etcd: EtcdCluster, job: str, nnodes: str,
                 nproc: int, *extra: str, spares: int = 0, root: Path | None = None) -> None:
        self.name, self.tmp, self.killed = name, tmp, False
        self.root, self.losses_path = root or tmp / "t1", tmp / "losses.jsonl"
        self.err = tmp / f"{name}.err"
        endpoint = "etcd://" + ",".join(m.url.removeprefix("http://") for m in etcd.members)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from tierckpt.cli import main; "
             "sys.argv[0] = 'tierckpt'; main()", "run", "--nnodes", nnodes,
             "--nproc-per-node", str(nproc), "--rdzv-endpoint", endpoint, "--rdzv-id", job,
             "--node-id", name, "--node-timeout", str(DETECT_S), "--spares", str(spares),
             "--heal-timeout", "60", "--", sys.executable, str(EXAMPLE),
             "--tier1", str(self.root), "--losses", str(self.losses_path), *SMALL, *extra],
            env=_env(), stdout=subprocess.DEVNULL, stderr=open(self.err, "w"),  # noqa: SIM115
            start_new_session=True)

    def lines(self) -> str:
        err = self.err.read_text(errors="replace")
        return "\n".join(x for x in err.splitlines() if x.startswith("tierckpt run"))

    def finish(self) -> str:
        """Wait for the node; its supervisor's lines (asserting it exited 0)."""
        self.proc.wait(timeout=TIMEOUT_S)
        assert self.proc.returncode == 0, self.err.read_text(errors="replace")[-6000:]
        return self.lines()

    def kill(self) -> None:
        """Lose the node: SIGKILL its supervisor and every worker at once."""
        self.killed = True
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()


class Cluster:
    """Nodes of one job sharing a tier-1 root (a shared file system) and one etcd."""

    def __init__(self, tmp: Path, etcd: EtcdCluster, nnodes: str, nproc: int,
                 *extra: str, own_roots: bool = False) -> None:
        self.tmp, self.etcd, self.nnodes, self.nproc, self.extra = tmp, etcd, nnodes, nproc, \
            extra
        self.own_roots = own_roots  # each node its own tier-1 root (else one shared root)
        self.job = job_id()
        tmp.mkdir(parents=True, exist_ok=True)
        self.nodes: dict[str, Node] = {}
        self.store = EtcdStore(etcd.endpoints, self.job,
                               timeout=datetime.timedelta(seconds=30))

    def start(self, name: str, *, spares: int = 0) -> Node:
        node = Node(self.tmp, name, self.etcd, self.job, self.nnodes, self.nproc,
                    *self.extra, spares=spares,
                    root=self.tmp / name / "t1" if self.own_roots else None)
        self.nodes[name] = node
        return node

    def holder(self, slot: int) -> str:
        k = f"nodes/slot/{slot}"
        return self.store.get(k).decode() if self.store.check([k]) else ""

    def wait_for(self, what: str, cond: Any, timeout: float = TIMEOUT_S) -> None:
        """Poll ``cond`` until true; fail at ``timeout`` or once a node ended."""
        end = time.monotonic() + timeout
        while not cond():
            ended = [n.name for n in self.nodes.values()
                     if not n.killed and n.proc.poll() is not None]
            assert not ended, f"node(s) {ended} ended before {what}"
            assert time.monotonic() < end, f"timed out waiting for {what}: " + "\n".join(
                n.lines() for n in self.nodes.values())
            time.sleep(0.02)

    def losses(self) -> list[dict[str, Any]]:
        return _losses(self.tmp / "losses.jsonl")

    def close(self) -> None:
        for n in self.nodes.values():
            n.stop()
        self.store.close()


@pytest.fixture
def cluster(tmp_path: Path, etcd_server: EtcdCluster) -> Any:
    made: list[Cluster] = []

    def make(nnodes: str, nproc: int, *extra: str, own_roots: bool = False) -> Cluster:
        c = Cluster(tmp_path / "job", etcd_server, nnodes, nproc, *extra,
                    own_roots=own_roots)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The uninterrupted run of the 2-rank DDP job: step -> loss bits."""
    return reference(tmp_path_factory.mktemp("ref2"), 2, "--parallel", "ddp")


@pytest.fixture(scope="module")
def ref3_ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    return reference(tmp_path_factory.mktemp("ref3"), 3, "--parallel", "ddp")


@pytest.fixture(scope="module")
def ref6(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    return reference(tmp_path_factory.mktemp("ref6"), 6)


def _start_in_order(c: Cluster, names: list[str], slots: int) -> None:
    """Start the nodes one by one so that the first ``slots`` hold slots 0.. in order."""
    for i, name in enumerate(names):
        c.start(name)
        if i < slots:
            c.wait_for(f"{name} to hold slot {i}", lambda i=i, name=name: c.holder(i) == name,
                       timeout=60)


@pytest.mark.slow
def test_a_lost_node_is_replaced_by_the_spare_node(
        cluster: Any, ref: dict[int, str]) -> None:
    c = cluster("2:3", 1, "--parallel", "ddp", "--step-sleep", "0.05")
    _start_in_order(c, ["n0", "n1", "spare"], 2)
    c.wait_for("step 12", lambda: len(c.losses()) >= 13)
    c.nodes["n1"].kill()
    lines = "\n".join(c.nodes[n].finish() for n in ("n0", "spare"))
    assert "node n1 lost: slot 1, ranks [1] taken over here; healing: generation 1" in lines, \
        lines
    assert "full restart" not in lines, lines
    same_losses(c.losses(), ref)
    procs = processes(c.tmp / "t1")
    assert [len(procs[r]) for r in (0, 1)] == [1, 2]  # rank 0 kept its process
    done = _events(c.tmp / "t1", ev.HEAL_DONE)
    assert [e["rank"] for e in done] == [0] and done[0]["dead"] == [1]
    # the last node out (either: each sees the other beating) cleared all but the end
    assert "keys cleared from etcd" in lines, lines
    assert c.store.job_keys() == ["nodes/closed", "nodes/done"]
    assert c.store.get("nodes/done") == b"0" and c.store.get("nodes/closed") in (b"n0", b"spare")


@pytest.mark.slow
def test_the_first_node_lost_heals_the_same_way(
        cluster: Any, ref: dict[int, str]) -> None:
    c = cluster("2:3", 1, "--parallel", "ddp", "--step-sleep", "0.05")
    _start_in_order(c, ["n0", "n1", "spare"], 2)
    c.wait_for("step 12", lambda: len(c.losses()) >= 13)
    c.nodes["n0"].kill()  # rank 0: the loss log, and the node that started first
    lines = "\n".join(c.nodes[n].finish() for n in ("n1", "spare"))
    assert "node n0 lost: slot 0, ranks [0] taken over here" in lines, lines
    assert "full restart" not in lines, lines
    same_losses(c.losses(), ref)
    procs = processes(c.tmp / "t1")
    assert [len(procs[r]) for r in (0, 1)] == [2, 1]  # rank 1 kept its process


@pytest.mark.slow
def test_without_a_spare_node_the_job_restarts_in_full(
        cluster: Any, ref: dict[int, str]) -> None:
    c = cluster("2", 1, "--parallel", "ddp", "--step-sleep", "0.05")
    _start_in_order(c, ["n0", "n1"], 2)
    c.wait_for("step 12", lambda: len(c.losses()) >= 13)
    c.nodes["n1"].kill()
    c.wait_for("slot 1 freed", lambda: c.holder(1) == "")
    c.start("n1-again")  # the scheduler brings a node back
    lines = "\n".join(c.nodes[n].finish() for n in ("n0", "n1-again"))
    assert "node n1 (slot 1) lost and no spare node waits: full restart" in lines, lines
    same_losses(c.losses(), ref)
    procs = processes(c.tmp / "t1")
    assert [len(procs[r]) for r in (0, 1)] == [2, 2]  # everyone started again


@pytest.mark.slow
def test_a_node_seen_lost_that_comes_back_is_fenced_off(
        cluster: Any, ref: dict[int, str]) -> None:
    # n1 stops (SIGSTOP: its heartbeat and its rank frozen) longer than the loss timeout:
    # the spare node takes its slot; when n1 resumes it finds the slot taken, ends its
    # worker and waits as a spare, so rank 1 never runs twice
    c = cluster("2:3", 1, "--parallel", "ddp", "--step-sleep", "0.05")
    _start_in_order(c, ["n0", "n1", "spare"], 2)
    c.wait_for("step 12", lambda: len(c.losses()) >= 13)
    n1 = c.nodes["n1"]
    os.killpg(n1.proc.pid, signal.SIGSTOP)
    c.wait_for("the spare node to take slot 1", lambda: c.holder(1) == "spare")
    os.killpg(n1.proc.pid, signal.SIGCONT)
    lines = "\n".join(c.nodes[n].finish() for n in ("n0", "spare", "n1"))
    assert "[n1]: slot 1 is held by another node now" in lines, lines
    assert "full restart" not in lines, lines
    same_losses(c.losses(), ref)


# -- flags and the workers' environment (fast) ---------------------------------------------


@pytest.mark.parametrize("text", ["0", "3:2", "a", "1:2:3", ""])
def test_bad_nnodes_say_what_to_give(text: str) -> None:
    with pytest.raises(ConfigError, match="MIN or MIN:MAX"):
        parse_nnodes(text)


def test_nnodes_and_endpoints_parse() -> None:
    assert parse_nnodes("2") == (2, 2) and parse_nnodes("2:4") == (2, 4)
    assert parse_endpoint("etcd://a:1,b:2") == "http://a:1,http://b:2"
    for bad in ("etcd://", "http://a:1", "etcd://host"):
        with pytest.raises(ConfigError, match="etcd://host:port"):
            parse_endpoint(bad)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("min_nodes", 3, "1 <= MIN <= MAX"), ("job", "a/b", "--rdzv-id"),
    ("node", "", "--node-id"), ("detect_s", 0, "detect_s")])
def test_bad_node_settings_are_refused(field: str, value: object, match: str) -> None:
    cfg: dict[str, Any] = {"launch": HealLaunch(nproc=1), "min_nodes": 2, "max_nodes": 2,
                           "endpoints": "http://a:1", "job": "j", "node": "n", field: value}
    with pytest.raises(ConfigError, match=match):
        NodeLaunch(**cfg)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "import sys; from tierckpt.cli import main; "
                           "sys.argv[0] = 'tierckpt'; main()", "run", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_refuses_half_a_multi_node_launch() -> None:
    proc = _cli("--nnodes", "2", "--", sys.executable, "-c", "pass")
    assert proc.returncode != 0 and "--rdzv-endpoint" in proc.stdout + proc.stderr
    proc = _cli("--rdzv-id", "j", "--", sys.executable, "-c", "pass")
    assert proc.returncode != 0 and "--nnodes MIN" in proc.stdout + proc.stderr


def test_every_node_gives_its_workers_global_ranks_and_the_store(
        tmp_path: Path, etcd_server: EtcdCluster) -> None:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent('''
        import json, os, sys
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "TIERCKPT_STORE", "TIERCKPT_STORE_JOB",
                "TIERCKPT_HEAL_ID", "TIERCKPT_HEAL_GEN")
        with open(sys.argv[1], "a") as f:
            f.write(json.dumps({k: os.environ.get(k) for k in keys}) + "\\n")
    '''))
    job, host = job_id(), etcd_server.url.removeprefix("http://")
    nodes = [subprocess.Popen(
        [sys.executable, "-c", "import sys; from tierckpt.cli import main; "
         "sys.argv[0] = 'tierckpt'; main()", "run", "--nnodes", "2", "--nproc-per-node", "2",
         "--spares", "0", "--rdzv-endpoint", f"etcd://{host}", "--rdzv-id", job,
         "--node-id", f"n{i}", "--", sys.executable, str(script), str(tmp_path / "env.jsonl")],
        stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in nodes:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    envs = sorted((json.loads(x) for x in (tmp_path / "env.jsonl").read_text().splitlines()),
                  key=lambda e: int(e["RANK"]))
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [(e["LOCAL_RANK"], e["GROUP_RANK"]) for e in envs] == [
        ("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")]
    assert all(e["WORLD_SIZE"] == "4" and e["LOCAL_WORLD_SIZE"] == "2"
               and e["GROUP_WORLD_SIZE"] == "2" and e["TIERCKPT_STORE"] == f"etcd://{host}"
               and e["TIERCKPT_STORE_JOB"] == job and e["TIERCKPT_HEAL_ID"] == f"{job}.0"
               and e["TIERCKPT_HEAL_GEN"] == "0" for e in envs)


@pytest.mark.slow
def test_three_nodes_of_two_ranks_fsdp2_lose_the_middle_node(
        cluster: Any, ref6: dict[int, str]) -> None:
    ref = ref6
    c = cluster("3:4", 2, "--step-sleep", "0.05")
    _start_in_order(c, ["n0", "n1", "n2", "spare"], 3)
    c.wait_for("step 12", lambda: len(c.losses()) >= 13)
    c.nodes["n1"].kill()
    lines = "\n".join(c.nodes[n].finish() for n in ("n0", "n2", "spare"))
    assert "node n1 lost: slot 1, ranks [2, 3] taken over here" in lines, lines
    assert "full restart" not in lines, lines
    same_losses(c.losses(), ref)
    procs = processes(c.tmp / "t1")
    assert [len(procs[r]) for r in range(6)] == [1, 1, 2, 2, 1, 1]
    done = _events(c.tmp / "t1", ev.HEAL_DONE)
    assert sorted(e["rank"] for e in done) == [0, 1, 4, 5]
    assert all(e["dead"] == [2, 3] for e in done)


@pytest.mark.slow
def test_the_spare_node_restores_from_tier2_with_an_empty_tier1(
        tmp_path: Path, cluster: Any, ref: dict[int, str]) -> None:
    # every node its own tier-1 root, as on real nodes: the spare node's is empty, so its
    # rank loads the newest complete checkpoint from tier 2, verified as every restore
    (tmp_path / "t2").mkdir()
    t2 = f"file://{tmp_path / 't2'}"
    c = cluster("2:3", 1, "--parallel", "ddp", "--step-sleep", "0.5", "--tier2", t2,
                own_roots=True)
    _start_in_order(c, ["n0", "n1", "spare"], 2)
    uploaded = Tier2Catalog(LocalStorage(tmp_path / "t2"))
    c.wait_for("step 9 in tier 2 and step 12", lambda: 9 in uploaded.complete_steps()
               and len(c.losses()) >= 13)  # the uploaders run at nice 19: slow here
    c.nodes["n1"].kill()
    lines = "\n".join(c.nodes[n].finish() for n in ("n0", "spare"))
    assert "node n1 lost: slot 1, ranks [1] taken over here" in lines, lines
    assert "full restart" not in lines, lines
    same_losses(c.losses(), ref)
    assert len(processes(c.tmp / "n0" / "t1")[0]) == 1  # rank 0 kept its process
    restored = [e for e in _events(c.tmp / "spare" / "t1", ev.RESTORE_DONE) if e["rank"] == 1]
    assert restored and restored[-1]["bytes_by_source"]["tier2"] > 0, restored


@pytest.mark.slow
def test_two_nodes_lost_at_once_are_replaced_in_one_heal(
        cluster: Any, ref3_ddp: dict[int, str]) -> None:
    ref = ref3_ddp
    c = cluster("3:5", 1, "--parallel", "ddp", "--step-sleep", "0.05")
    _start_in_order(c, ["n0", "n1", "n2", "s1", "s2"], 3)
    c.wait_for("step 12", lambda: len(c.losses()) >= 13)
    lost = [c.nodes[name] for name in ("n1", "n2")]
    for n in lost:  # back to back: a rank of n2 must not begin the heal for n1 first
        n.killed = True
        os.killpg(n.proc.pid, signal.SIGKILL)
    for n in lost:
        n.proc.wait()
    lines = "\n".join(c.nodes[n].finish() for n in ("n0", "s1", "s2"))
    assert lines.count("taken over here; healing: generation 1") == 2, lines
    assert "full restart" not in lines and "generation 2" not in lines, lines
    same_losses(c.losses(), ref)
    procs = processes(c.tmp / "t1")
    assert [len(procs[r]) for r in range(3)] == [1, 2, 2]  # rank 0 kept its process
    (done,) = _events(c.tmp / "t1", ev.HEAL_DONE)
    assert done["rank"] == 0 and done["dead"] == [1, 2]


@pytest.mark.slow
def test_the_node_with_an_etcd_member_lost_heals(
        tmp_path: Path, etcd_cluster: Any, ref: dict[int, str]) -> None:
    # a 3-member etcd, its first member "on" node n0: both killed at once; the store
    # fails over to the other members (a new leader within about an election) and the
    # spare node takes n0's ranks as for any node
    etcd = etcd_cluster(3)
    c = Cluster(tmp_path / "job", etcd, "2:3", 1, "--parallel", "ddp", "--step-sleep", "0.05")
    try:
        _start_in_order(c, ["n0", "n1", "spare"], 2)
        c.wait_for("step 12", lambda: len(c.losses()) >= 13)
        etcd.kill(0)
        c.nodes["n0"].kill()
        lines = "\n".join(c.nodes[n].finish() for n in ("n1", "spare"))
        assert "node n0 lost: slot 0, ranks [0] taken over here" in lines, lines
        assert "full restart" not in lines, lines
        same_losses(c.losses(), ref)
        assert len(processes(c.tmp / "t1")[1]) == 1  # rank 1 kept its process
    finally:
        c.close()


def test_a_job_id_that_already_ended_is_refused(etcd_server: EtcdCluster) -> None:
    job, host = job_id(), etcd_server.url.removeprefix("http://")
    with EtcdStore(etcd_server.endpoints, job) as store:
        store.set("nodes/done", "0")
    proc = _cli("--nnodes", "1", "--rdzv-endpoint", f"etcd://{host}", "--rdzv-id", job,
                "--", sys.executable, "-c", "pass")
    assert proc.returncode != 0 and "already ended" in proc.stderr, proc.stderr


def test_a_late_heartbeat_is_a_loss_only_for_a_node_whose_ranks_did_not_leave(
        etcd_server: EtcdCluster) -> None:
    """The shortcut to a loss (silent for four heartbeats while survivors leave their
    generation) spares a node whose own ranks left: it is alive, its heartbeat late (an
    etcd election, a stall under load); a node whose ranks are silent too is lost."""
    from tierckpt.heal.launcher import _Incarnation
    from tierckpt.heal.membership import Membership
    from tierckpt.heal.nodes import NodeSupervisor

    job = job_id()
    sup = NodeSupervisor([sys.executable, "-c", "pass"], NodeLaunch(
        launch=HealLaunch(nproc=2, spares=0), min_nodes=2, max_nodes=3,
        endpoints=etcd_server.endpoints, job=job, node="watcher", detect_s=30.0),
        say=lambda line: None)
    try:
        for name in ("late", "gone"):  # registered, then silent
            Membership(sup.store, name, detect_s=30.0).close()
        inc = _Incarnation(id=sup._inc_id(0), restart=0)
        sup.store.set(sup._key(inc, "gen"), "0")
        sup.store.add(sup._key(inc, "leaving/0"), 1)  # slot 1's ranks (2, 3) left gen 0
        sup.store.set(sup._key(inc, "left/0/2"), "1")
        seen: dict[str, bool] = {}
        end = time.monotonic() + sup.nodes.suspect_s + 1.0
        while time.monotonic() < end:  # looks as a supervisor does (a gap resets counts)
            seen = {"late": sup._lost("late", 1, 0), "gone": sup._lost("gone", 0, 0)}
            time.sleep(0.1)
        assert seen == {"late": False, "gone": True}
    finally:
        sup.store.close()
        sup._spares.close()


@pytest.mark.slow
def test_a_node_whose_supervisor_alone_died_is_replaced(
        cluster: Any, ref: dict[int, str]) -> None:
    # only n1's supervisor is killed: its worker, an orphan now, kills itself at once
    # (TIERCKPT_ORPHANS=kill) instead of training on beside its replacement
    c = cluster("2:3", 1, "--parallel", "ddp", "--step-sleep", "0.05")
    _start_in_order(c, ["n0", "n1", "spare"], 2)
    c.wait_for("step 12", lambda: len(c.losses()) >= 13)
    os.kill(c.nodes["n1"].proc.pid, signal.SIGKILL)
    lines = "\n".join(c.nodes[n].finish() for n in ("n0", "spare"))
    assert "node n1 lost: slot 1, ranks [1] taken over here" in lines, lines
    assert "did not leave" not in lines and "full restart" not in lines, lines
    same_losses(c.losses(), ref)
    assert [len(processes(c.tmp / "t1")[r]) for r in (0, 1)] == [1, 2]
    assert [e["rank"] for e in _events(c.tmp / "t1", ev.LAUNCHER_LOST)] == [1]
    assert not _events(c.tmp / "t1", ev.PREEMPT_NOTICE)


@pytest.mark.slow
def test_the_spare_node_lost_while_it_heals_means_a_full_restart(
        cluster: Any, ref: dict[int, str]) -> None:
    c = cluster("2:3", 1, "--parallel", "ddp", "--step-sleep", "0.05")
    _start_in_order(c, ["n0", "n1", "spare"], 2)
    c.wait_for("step 12", lambda: len(c.losses()) >= 13)
    c.nodes["n1"].kill()
    c.wait_for("the spare node to take slot 1", lambda: c.holder(1) == "spare")
    c.nodes["spare"].kill()  # its rank 1 is loading: generation 1 is not whole
    c.wait_for("slot 1 freed", lambda: c.holder(1) == "")
    c.start("n1-again")
    lines = "\n".join(c.nodes[n].finish() for n in ("n0", "n1-again"))
    assert "node spare (slot 1) lost and no spare node waits: full restart" in lines, lines
    same_losses(c.losses(), ref)
