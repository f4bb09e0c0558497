"""``_torch/planner.py``: the global plan's checks give DCP's verdicts — every out-of-bounds
chunk, overlap and volume error it reports, and none where it reports none — on FSDP-style
dim-0 shards (the case DCP sweeps quadratically), 2-D block tilings, empty shards past the
end, and broken plans; the ``planner_data`` merge equals ``dict(ChainMap(...))``."""

from __future__ import annotations

import random
from collections import ChainMap

import pytest
import torch
from torch.distributed.checkpoint.default_planner import (
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from tierckpt._torch.planner import SavePlanner, merge_first_wins, validate_global_plan


def _item(fqn: str, size: tuple[int, ...], offsets: tuple[int, ...],
          sizes: tuple[int, ...]) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(
                         chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                         properties=TensorProperties(dtype=torch.float32),
                         size=torch.Size(size)))


def _dim0(world: int, size: tuple[int, int]) -> list[list[tuple[tuple[int, ...], ...]]]:
    """FSDP's shards: torch.chunk along dim 0, ranks past the end empty at offset = size."""
    step = -(-size[0] // world)
    out = []
    for r in range(world):
        off = min(r * step, size[0])
        out.append([((off, 0), (min(step, size[0] - off), size[1]))])
    return out


def _plans(shards: dict[str, tuple[tuple[int, ...], list]]) -> list[SavePlan]:
    world = max(len(v[1]) for v in shards.values())
    return [SavePlan([_item(fqn, size, off, sz) for fqn, (size, per_rank) in shards.items()
                      if r < len(per_rank) for off, sz in per_rank[r]], planner_data={})
            for r in range(world)]


def _verdicts(plans: list[SavePlan]) -> tuple[list[str], list[str]]:
    global_plan, md = create_default_global_save_plan(plans)
    return sorted(_validate_global_plan(global_plan, md)), sorted(
        validate_global_plan(global_plan, md))


def test_fsdp_shards_and_block_tilings_are_valid_as_dcp_says() -> None:
    blocks = [[((i * 4, j * 6), (4, 6))] for i in range(3) for j in range(2)]
    plans = _plans({"w2": ((64, 160), _dim0(24, (64, 160))),  # dim 1 larger: DCP's W² case
                    "wk": ((10, 32), _dim0(24, (10, 32))),     # most ranks empty
                    "blocks": ((12, 12), blocks)})
    dcp, ours = _verdicts(plans)
    assert dcp == ours == []


@pytest.mark.parametrize("seed", range(8))
def test_broken_plans_get_dcps_errors(seed: int) -> None:
    rng = random.Random(seed)
    per_rank = _dim0(8, (64, 160))
    r = rng.randrange(8)
    ((off, _), sz), = per_rank[r]
    kind = seed % 3
    if kind == 0:  # overlaps its neighbour
        per_rank[r] = [((max(0, off - 3), 0), (sz[0] + 3, sz[1]))]
    elif kind == 1:  # leaves a gap
        per_rank[r] = [((off, 0), (sz[0] - 1, sz[1]))]
    else:  # out of bounds
        per_rank[r] = [((off, 0), (sz[0], sz[1] + 1))]
    dcp, ours = _verdicts(_plans({"w": ((64, 160), per_rank)}))
    assert dcp and dcp == ours


def test_the_merge_is_chainmaps() -> None:
    maps = [{"a": 1, f"r{i}": i, "shared": i} for i in range(5)]
    assert merge_first_wins(maps) == dict(ChainMap(*maps))
    assert merge_first_wins(maps)["shared"] == 0


def test_the_planner_builds_dcps_global_plan() -> None:
    plans = _plans({"w": ((64, 160), _dim0(4, (64, 160)))})
    for p, r in zip(plans, range(4), strict=True):
        p.planner_data.update({"w": ("w",), f"rank_state.{r}": ("rank_state", str(r))})
    ours = SavePlanner()
    ours.flatten_state_dict = True
    got_plan, got_md = ours._create_global_plan(plans)
    want_plan, want_md = create_default_global_save_plan(plans)
    assert got_plan == want_plan and got_md.state_dict_metadata == want_md.state_dict_metadata
    assert got_md.planner_data == dict(ChainMap(*[p.planner_data for p in want_plan]))
    bad = _plans({"w": ((64, 160), [[((0, 0), (40, 160))], [((30, 0), (34, 160))]])})
    with pytest.raises(ValueError, match="overlapping chunks"):
        ours._create_global_plan(bad)
