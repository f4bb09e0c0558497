"""The ring replica between two real gloo ranks (one per simulated node): each node's
files arrive on its partner CRC-checked and committed with their own marker; a file damaged
in the sender's RAM is caught on arrival and never committed, and the other direction is
unaffected."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from tests._launch import spawn
from tests._synthetic import make_checkpoint
from tierckpt._ports import free_port
from tierckpt.errors import CorruptDataError
from tierckpt.format import layout
from tierckpt.runtime.topology import Comm
from tierckpt.tier0.replicate import holder_of, replicate, ring
from tierckpt.tier0.root import Tier0Root
from tierckpt.tier0.transfer import PIECE
from tierckpt.tier1.manifests import read_committed

DOMAINS = ((0,), (1,))
SIZES = {"__0_0.distcp": (PIECE + 1000, 0), "__1_0.distcp": (5000, 1),
         "__1_1.distcp": (0, 1), ".metadata": (300, None)}


def _rank(rank: int, port: int, base: str, damage: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        comm = Comm.create(60.0)
        root = Tier0Root(path=Path(base) / f"node{rank}", tier1=Path(base) / f"t1-{rank}")
        lock = root.open(dir_mode=0o750, file_mode=0o640)
        make_checkpoint(root.path, 5, SIZES, domains=DOMAINS, world_size=2,
                        only_ranks={rank})
        committed = read_committed(root.own.step_dir(5), step=5)
        if damage and rank == 1:  # node 1's RAM rots after its own commit
            p = root.own.step_dir(5) / "__1_0.distcp"
            data = bytearray(p.read_bytes())
            data[10] ^= 0xFF
            p.write_bytes(bytes(data))
        try:
            got = replicate(comm, DOMAINS, (rank,), root, committed, file_mode=0o640,
                            dir_mode=0o750)
            result = f"ok {got}"
        except CorruptDataError as e:
            result = f"corrupt {e}"
        Path(out, f"rank{rank}").write_text(result)
        lock.release()
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, damage: bool) -> dict[int, str]:
    out = tmp_path / "out"
    out.mkdir()
    spawn(_rank, free_port(), str(tmp_path), damage, str(out), nprocs=2)
    return {r: (out / f"rank{r}").read_text() for r in (0, 1)}


def test_ring_partners() -> None:
    three = ((0, 1), (2,), (3, 4))
    assert ring(three, (2,)) == ((3, 4), (0, 1))
    assert holder_of(three, (3, 4)) == (0, 1) and ring(((0,),), (0,)) is None


@pytest.mark.slow
def test_each_node_holds_its_partners_files_committed(tmp_path: Path) -> None:
    res = _run(tmp_path, damage=False)
    assert res[0] == "ok 5300" and res[1] == f"ok {PIECE + 1000 + 300}"
    for node, other in ((0, 1), (1, 0)):
        peer = tmp_path / f"node{node}" / "peer" / layout.step_dirname(5)
        m = read_committed(peer, step=5).manifest  # its own marker, verified
        names = sorted(p.name for p in peer.iterdir() if p.name.startswith("__"))
        assert names == sorted(f.name for f in m.files_for_ranks({other})
                               if f.name.startswith("__"))
        src = tmp_path / f"node{other}" / layout.step_dirname(5)
        for n in names:
            assert (peer / n).read_bytes() == (src / n).read_bytes()


@pytest.mark.slow
def test_damaged_sender_ram_is_caught_on_arrival_and_not_committed(tmp_path: Path) -> None:
    res = _run(tmp_path, damage=True)
    assert res[0].startswith("corrupt __1_0.distcp from rank 1: CRC32C"), res[0]
    assert res[1].startswith("ok")  # the other direction is unaffected
    peer0 = tmp_path / "node0" / "peer"
    assert not (peer0 / layout.step_dirname(5)).exists()
    assert not any(peer0.iterdir())  # no half-received temporary left behind
