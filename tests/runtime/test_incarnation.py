"""The start-up handshake (runtime/incarnation.py) on a real TCPStore: leftovers of earlier
incarnations are ignored, and a rank that never comes is a CheckpointError in time."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from tierckpt.errors import CheckpointError
from tierckpt.runtime.incarnation import agree_incarnation


def _serve() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30),
                         wait_for_workers=False)


def _client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False,
                         timeout=timedelta(seconds=30))


def test_handshake_ignores_leftovers_of_earlier_incarnations() -> None:
    server = _serve()
    # What a previous incarnation of a 3-rank job leaves behind in the shared store.
    server.set("tierckpt/join/nonce/1", "old-nonce-1")
    server.set("tierckpt/join/nonce/2", "old-nonce-2")
    server.set("tierckpt/join/grant/1", json.dumps({"nonce": "old-nonce-1",
                                                    "incarnation": "old"}))
    server.set("tierckpt/join/grant/2", json.dumps({"nonce": "old-nonce-2",
                                                    "incarnation": "old"}))
    server.add("tierckpt/join/ack/old", 2)
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            results[rank] = agree_incarnation(_client(server), rank, 3, timedelta(seconds=30))
        except BaseException as e:  # surfaced by the assert below
            errors.append(e)

    # Rank 0 starts first and reads only the stale nonces before the others arrive.
    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 2, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(set(results.values())) == 1 and sorted(results) == [0, 1, 2]
    assert results[0] != "old"


def test_handshake_times_out_when_a_rank_never_comes() -> None:
    server = _serve()
    with pytest.raises(CheckpointError, match="only 0 of 1 other ranks joined"):
        agree_incarnation(_client(server), 0, 2, timedelta(seconds=0.5))
    with pytest.raises(CheckpointError, match="rank 0 did not answer"):
        agree_incarnation(_client(server), 1, 2, timedelta(seconds=0.5))
