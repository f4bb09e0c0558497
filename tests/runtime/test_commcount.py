"""runtime/commcount.py on two real gloo ranks: every object and tensor collective DCP and
tierckpt call, with known payloads, counted by kind with the exact pickled bytes each rank
sent and received (a source's or destination's own entry stays local), calls from another
thread included, and ``torch.distributed`` restored on exit."""

from __future__ import annotations

import pickle
import threading
from typing import Any

import torch
import torch.distributed as dist

from bench._dist import run_ranks
from tierckpt.runtime.commcount import CommCounter, Counts, counting


def _obj(rank: int) -> bytes:
    return bytes([rank]) * (100 * (rank + 1))


def _n(obj: Any) -> int:
    return len(pickle.dumps(obj))


SCATTERED = ["to rank 0", "to rank 1, a longer entry"]
PAYLOAD = {"manifest": b"m" * 500}


def _rank(rank: int, world: int, job: None) -> dict[str, Any]:
    originals = {n: getattr(dist, n) for n in ("all_gather_object", "all_reduce")}
    with counting() as counts:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, _obj(rank))
        into: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(_obj(rank), into, dst=0)
        out: list[Any] = [None]
        dist.scatter_object_list(out, SCATTERED if rank == 0 else None, src=0)
        box = [PAYLOAD if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        t = threading.Thread(target=dist.all_reduce, args=(torch.ones(10),))
        t.start()  # the saver calls collectives from its own thread
        t.join()
        dist.broadcast(torch.zeros(3, dtype=torch.float64), 1)  # positional src, not rank 0
        dist.barrier()
    restored = all(getattr(dist, n) is f for n, f in originals.items())
    assert gathered[1 - rank] == _obj(1 - rank) and out[0] == SCATTERED[rank]
    assert box[0] == PAYLOAD and (into is None or into[1] == _obj(1))
    return {"counts": counts.to_json(), "restored": restored}


def test_two_ranks_count_every_collective_and_its_bytes() -> None:
    got = [r["counts"] for r in run_ranks(2, _rank, None)]
    kinds = {"all_gather_object": 1, "gather_object": 1, "scatter_object_list": 1,
             "broadcast_object_list": 1, "all_reduce": 1, "broadcast": 1, "barrier": 1}
    for c in got:
        assert c["by_kind"] == kinds and c["collectives"] == 7
    o0, o1, s1, p = _n(_obj(0)), _n(_obj(1)), _n(SCATTERED[1]), _n(PAYLOAD)
    # rank 0: all-gather (o0 out, o1 in), gather destination (o1 in), scatter source (its
    # own entry stays), broadcast source, all_reduce 40 both ways, broadcast receiver 24
    assert got[0]["sent"] == o0 + s1 + p + 40
    assert got[0]["received"] == o1 + o1 + 40 + 24
    # rank 1: all-gather (o1 out, o0 in), gather sender, scatter and broadcast receiver
    assert got[1]["sent"] == o1 + o1 + 40 + 24
    assert got[1]["received"] == o0 + s1 + p + 40


def test_the_counter_restores_torch_distributed() -> None:
    before = dist.all_gather_object
    with CommCounter() as c:
        assert dist.all_gather_object is not before
    assert dist.all_gather_object is before and c.counts.total == 0


def test_counts_to_json() -> None:
    c = Counts()
    c.calls.update({"gather_object": 2, "barrier": 1})
    c.sent, c.received = 10, 30
    assert c.to_json() == {"collectives": 3, "by_kind": {"gather_object": 2, "barrier": 1},
                           "sent": 10, "received": 30}
