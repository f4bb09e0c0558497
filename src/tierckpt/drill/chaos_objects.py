"""The chaos drill's hands on tier 2's content objects (``--dedup``; a ``file://`` tier 2).

Tier 2 stores each file's bytes once under its SHA-256 (docs/format.md, "Tier 2: each
file's bytes stored once"); these faults hit what that sharing could make worse:

- :func:`damage_object` flips one byte of a content object, or deletes it, behind the
  job's back (bit rot, a lifecycle rule, a hand that cleaned up);
- :func:`cut_deletion` deletes a tier-2 step as retention and ``tierckpt gc`` do (marker
  first, the step's own objects, then a sweep of what nothing references) in a child
  process that SIGKILLs itself just before its Nth deletion: a deletion cut short at a
  seeded point (the sweep lease it leaves names a process that is gone: the next upload
  removes it at once).

:func:`tier2_maps` and :func:`leftovers` read what the drill needs to judge them. Run as
``python -m tierckpt.drill.chaos_objects TIER2_DIR STEP N`` the module is that child.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tierckpt.drill import chaos_faults as cf
from tierckpt.format import objmap
from tierckpt.tier2 import sweep as sw
from tierckpt.tier2.catalog import Tier2Catalog
from tierckpt.tier2.storage import LocalStorage

__all__ = ["cut_deletion", "damage_object", "leftovers", "tier2_maps", "unique_objects"]

_CUT_TIMEOUT_S = 120.0
CUT_WINDOW_S = 2.0
"""The sweep window the cut deletion declares in its lease (the job's is
:data:`~tierckpt.tier2.sweep.SWEEP_WINDOW_S`): an uploader on another machine that meets
the lease a killed sweep left waits twice that (4 s here); on this machine the lease names
a process that is gone and goes at once."""


def tier2_maps(root: Path) -> dict[int, dict[str, str]]:
    """Each complete step of the ``file://`` tier 2 at ``root`` → its map (member → content
    key); a step without a map (written before content addressing) maps to ``{}``."""
    with LocalStorage(root) as storage:
        catalog = Tier2Catalog(storage)
        out = {}
        for step in catalog.complete_steps():
            m = catalog.resolve(step).objmap
            out[step] = m.keys() if m is not None else {}
        return out


def unique_objects(maps: dict[int, dict[str, str]], step: int) -> list[tuple[str, str]]:
    """``(member, key)`` of the content objects ``step`` needs and no other step does,
    shards first (then the other members), each group by name."""
    others = {k for s, m in maps.items() if s != step for k in m.values()}
    mine = [(n, k) for n, k in maps.get(step, {}).items() if k not in others]
    return sorted(mine, key=lambda nk: (not nk[0].endswith(".distcp"), nk[0]))


def damage_object(root: Path, key: str, variant: str, pick: float) -> str:
    """Flip one byte (``pick`` chooses it) of the content object ``key``, or delete it
    (``variant`` ``"missing"``); returns what was done."""
    path = root / key
    if variant == "missing":
        path.unlink()
        return f"removed tier 2's {key}"
    return cf.flip_file(path, pick).replace(f"{path.parent.name}/", "tier 2's objects/sha256/")


def cut_deletion(root: Path, step: int, kill_at: int) -> str:
    """Delete ``step`` from the ``file://`` tier 2 at ``root`` in a child process that
    SIGKILLs itself just before its ``kill_at``-th deletion (1: before the marker goes);
    returns where it died, or that it finished first."""
    r = subprocess.run([sys.executable, "-m", "tierckpt.drill.chaos_objects", str(root),
                        str(step), str(kill_at)], capture_output=True, text=True,
                       timeout=_CUT_TIMEOUT_S)
    done = [ln.split(" ", 1)[1] for ln in r.stdout.splitlines() if " " in ln]
    if r.returncode == -signal.SIGKILL:
        return (f"deleting tier 2's step {step}: SIGKILLed before deletion {kill_at} "
                f"({done[-1] if done else '?'}), {len(done) - 1} done")
    if r.returncode != 0:
        raise OSError(f"deleting tier 2's step {step} failed (exit {r.returncode}): "
                      f"{r.stderr.strip()[-400:]}")
    return f"deleted tier 2's step {step} in {len(done)} deletions (before deletion {kill_at})"


def leftovers(root: Path) -> tuple[int, int]:
    """``(orphans, leases)`` on the ``file://`` tier 2 at ``root``: content objects no map
    of a complete step and no upload part names, and sweep leases."""
    with LocalStorage(root) as storage:
        catalog = Tier2Catalog(storage)
        refs = sw.references(storage, catalog.objects())
        orphans = set(catalog.content()) - refs
        leases = {i.key for i in storage.list(objmap.SWEEPS)}
        return len(orphans), len(leases)


class _CutShort(LocalStorage):
    """A ``file://`` tier 2 whose process dies (SIGKILL, nothing cleaned up) just before
    its ``kill_at``-th deletion; each deletion is printed first, numbered."""

    def __init__(self, root: Path, kill_at: int) -> None:
        super().__init__(root)
        self.kill_at, self.done = kill_at, 0

    def delete(self, key: str) -> None:
        self.done += 1
        print(f"{self.done} {key}", flush=True)
        if self.done == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        super().delete(key)


def _main(argv: list[str]) -> int:
    root, step, kill_at = Path(argv[0]), int(argv[1]), int(argv[2])
    with _CutShort(root, kill_at) as storage:
        Tier2Catalog(storage, sweep_window_s=CUT_WINDOW_S).delete(step)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
