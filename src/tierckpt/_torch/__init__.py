"""The one fence around torch's private names: every private torch API tierckpt relies on
is named in this package and nowhere else (tests/_torch/test_fence.py scans the tree).

=============================  ==============================================================
module                         what it borrows (tested on :data:`TESTED`)
=============================  ==============================================================
:mod:`~tierckpt._torch.dcp`    DCP's file-record types (``_StorageInfo``, ``_StoragePrefix``),
                               nested-dict flattening, chunk lists, ``narrow_tensor_by_index``,
                               how a ``torch.layout`` and a memory format pickle
:mod:`~tierckpt._torch.core`   a tensor's version counter, ``flatten_dense_tensors``, Adam's
                               ``step`` dtype, the default group's store
:mod:`~tierckpt._torch.planner`  DCP's ``DefaultSavePlanner._create_global_plan`` and its box
                               checks, replaced by an O(n log n) version
:mod:`~tierckpt._torch.fsdp2`  FSDP2's per-module state, parameter groups, mesh infos and
                               device-mesh group registry; a DDP wrapper's reducer: what a heal
                               resets and rebinds
=============================  ==============================================================

The DCP and core names are used on every save and restore: a torch that renamed one fails
at import or on first use, loudly. The FSDP2/DDP surgery is used only by a heal, which
declines outside :data:`TESTED` (:func:`untested`): the launcher then restarts the whole job,
which needs none of it.
"""

from __future__ import annotations

import torch

TESTED: tuple[str, ...] = ("2.13", "2.14")
"""``major.minor`` torch releases CI has run every use of this package on: the whole suite
on 2.13; on 2.14 (``make test-torch-next``) the fast suite and every slow test marked
``fence`` (the FSDP2 and DDP heals)."""


def release(version: str | None = None) -> str:
    """``major.minor`` of ``version`` (default: the torch imported)."""
    v = (version or torch.__version__).split("+", 1)[0]
    return ".".join(v.split(".")[:2])


def untested(feature: str, version: str | None = None) -> str | None:
    """Why ``feature`` (one that needs torch's internals) must decline on this torch, or
    None when this torch's release is in :data:`TESTED`."""
    if release(version) in TESTED:
        return None
    return (f"{feature} relies on torch internals tested on torch {', '.join(TESTED)}; "
            f"this is torch {version or torch.__version__}, where it is not run")
