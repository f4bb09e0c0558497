"""The chaos drill's hands: inject each fault for real, and watch what the job records.

Processes: the job's ranks and uploaders are found in ``/proc`` (a rank's pid from its
``process_start`` event; its uploader is the child whose command line runs
``tierckpt.uploader``). Files: damage, partial commits, wiped roots and a full tier 1 are
changes to a node's tier-1 root made while the kernel enforces everything (a real ENOSPC
from a size-limited tmpfs); a wiped or damaged node RAM is the same to its tier-0 root
(which has a tier-1 root's layout, plus the partner's replica in ``peer/``). Tier 2
``file://`` goes down by renaming its directory away.
Linux only; mounting a tmpfs needs root (without it, the full-disk fault is left out).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from tierckpt import _proc
from tierckpt.format import layout
from tierckpt.tier0.root import PEER_DIR

__all__ = ["FILL_NAME", "EventTail", "Tier2Outage", "children", "damage", "fill", "find_uploader",
           "flip_file", "flip_shard", "kill", "mount_tmpfs", "processes", "ram_steps",
           "rebuilt_from_parts", "remove_step", "send", "step_dirs", "unmount", "unmount_under",
           "wipe", "wipe_ram"]

FILL_NAME = ".chaos-fill"
"""The file that fills a node's tier 1 (ignored by every tier-1 reader: not a step name)."""
_CHUNK = 1 << 20
_RECORD_START = b'{"event": '  # how EventLog starts every line


class EventTail:
    """Reads a node's ``events.jsonl`` as it grows, keeping every event seen, in order.

    A file that was replaced or truncated (a wiped root) is read again from its start;
    what was read before stays in :attr:`events`. A line without its newline yet is left
    for the next :meth:`poll`. A record glued to the torn start of another (a short write
    on a full disk leaves one mid-file) is recovered and counted in :attr:`torn`.
    """

    def __init__(self, path: Path, node: int) -> None:
        self.path, self.node = path, node
        self.events: list[dict[str, Any]] = []
        self.torn = 0
        self._ino: int | None = None
        self._offset = 0
        self._partial = b""

    def poll(self) -> int:
        """Read what was appended; returns how many events were new."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._ino, self._offset, self._partial = None, 0, b""
            return 0
        if st.st_ino != self._ino or st.st_size < self._offset:
            self._ino, self._offset, self._partial = st.st_ino, 0, b""
        if st.st_size == self._offset:
            return 0
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(st.st_size - self._offset)
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        n = 0
        for line in lines:
            rec = self._parse(line)
            if rec is not None:
                rec["node"] = self.node
                self.events.append(rec)
                n += 1
        return n

    def _parse(self, line: bytes) -> dict[str, Any] | None:
        try:
            rec = json.loads(line)
        except ValueError:
            start = line.rfind(_RECORD_START, 1)
            if start < 0:
                return None
            self.torn += 1
            try:
                rec = json.loads(line[start:])
            except ValueError:
                return None
        return rec if isinstance(rec, dict) and "event" in rec else None


# --- processes --------------------------------------------------------------------------------

def processes(marker: str) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every live process (not this one, not a zombie) whose
    command line contains ``marker``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        cmd, fields = _proc.cmdline(name), _proc.stat_fields(name)
        if cmd is None or fields is None:
            continue
        if marker in cmd and fields[0] != "Z":
            out.append((int(name), cmd))
    return out


def children(ppid: int, marker: str) -> list[int]:
    """Pids of the live children of ``ppid`` whose command line contains ``marker``."""
    out = []
    for pid, _ in processes(marker):
        if _proc.parent(pid) == ppid:
            out.append(pid)
    return sorted(out)


def find_uploader(rank_pid: int) -> int | None:
    """The pid of the uploader child (``python -m tierckpt.uploader``) of ``rank_pid``."""
    found = children(rank_pid, "tierckpt.uploader")
    return found[0] if found else None


def kill(pid: int) -> bool:
    """SIGKILL ``pid``; False when it no longer exists."""
    return send(pid, signal.SIGKILL)


def send(pid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to ``pid`` (a notice, a kill); False when it no longer exists."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


# --- tier 2 -----------------------------------------------------------------------------------

class Tier2Outage:
    """A ``file://`` tier 2 made unavailable by renaming its directory away, and back."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.away = root.with_name(root.name + ".down")
        self.down = False

    def start(self) -> None:
        os.rename(self.root, self.away)
        self.down = True

    def end(self) -> None:
        if self.down:
            os.rename(self.away, self.root)
            self.down = False


# --- tier 1 -----------------------------------------------------------------------------------

def step_dirs(root: Path) -> tuple[set[int], int]:
    """A root's complete steps and how many saves or fetches are in progress (tmp dirs)."""
    complete, tmp = set(), 0
    with contextlib.suppress(FileNotFoundError):
        for e in os.scandir(root):
            step = layout.parse_step_dirname(e.name)
            if step is not None and os.path.exists(os.path.join(e.path, layout.COMPLETE)):
                complete.add(step)
            elif layout.parse_tmp_dirname(e.name) is not None:
                tmp += 1
    return complete, tmp


def fill(root: Path) -> tuple[Path, int]:
    """Fill the file system of ``root`` until it returns ENOSPC; ``(file, bytes)``."""
    path = root / FILL_NAME
    written = 0
    with open(path, "ab", buffering=0) as f:
        for size in (_CHUNK, 64 << 10, 4 << 10, 512):
            block = b"\0" * size
            try:
                while True:
                    written += f.write(block) or 0
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
        with contextlib.suppress(OSError):
            os.fsync(f.fileno())
    return path, written


def _own_files(d: Path) -> tuple[list[Path], list[Path]]:
    shards = sorted(p for p in d.iterdir() if layout.shard_rank(p.name) is not None)
    meta = [d / layout.METADATA] if (d / layout.METADATA).exists() else []
    return shards, meta


def damage(root: Path, step: int, variant: str, pick: float) -> str:
    """Damage ``root``'s checkpoint of ``step``: truncate a shard to half, flip one byte of
    a shard or ``.metadata``, delete a shard, ``.metadata`` or ``manifest.json``, or delete
    the COMPLETE marker. ``pick`` in [0, 1) chooses the file and the byte. Returns what
    was done."""
    d = root / layout.step_dirname(step)
    shards, meta = _own_files(d)
    if variant == "missing_marker":
        (d / layout.COMPLETE).unlink()
        return f"removed {d.name}/{layout.COMPLETE}"
    files = {"truncate_shard": shards, "flip_byte": shards + meta,
             "missing_file": shards + meta + [d / layout.MANIFEST]}[variant] or meta
    target = files[int(pick * len(files)) % len(files)]
    size = target.stat().st_size
    if variant == "truncate_shard":
        os.truncate(target, size // 2)
        return f"truncated {d.name}/{target.name} from {size} to {size // 2} bytes"
    if variant == "flip_byte":
        return flip_file(target, pick)
    target.unlink()
    return f"removed {d.name}/{target.name}"


def flip_file(target: Path, pick: float) -> str:
    """Flip one byte of ``target`` (``pick`` in [0, 1) chooses it); returns what was done."""
    size = target.stat().st_size
    offset = int((pick * 7919) % 1 * size) if size else 0
    with open(target, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    return f"flipped byte {offset} of {target.parent.name}/{target.name}"


def flip_shard(root: Path, step: int, pick: float) -> str:
    """Flip one byte of one shard of ``root``'s checkpoint of ``step`` (a tier-0 copy or
    replica: only a full CRC32C check, or the one while it is read, can see it). ``pick``
    in [0, 1) chooses the shard and the byte."""
    shards, _ = _own_files(root / layout.step_dirname(step))
    return flip_file(shards[int(pick * len(shards)) % len(shards)], pick)


def ram_steps(ram: Path) -> tuple[set[int], set[int]]:
    """A tier-0 root's complete steps: its own, and those of the replica it holds."""
    return step_dirs(ram)[0], step_dirs(ram / PEER_DIR)[0]


def wipe_ram(ram: Path) -> str:
    """Remove a node's tier-0 root (its own copies and the partner's replica): the RAM of a
    rebooted or replaced node."""
    if not ram.exists():
        return f"{ram} was already empty"
    n = sum(1 for p in ram.rglob("*") if p.is_file())
    shutil.rmtree(ram)
    return f"wiped the node's RAM {ram} ({n} files)"


def rebuilt_from_parts(root: Path, step: int) -> bool:
    """Whether ``root``'s checkpoint of ``step`` lacks ``manifest.json`` but holds its
    marker and a manifest part: the marker vouches for the parts, which rebuild the
    manifest, so a restore reads the copy safely and loses nothing, though a full check
    reports the file missing (docs/format.md)."""
    d = root / layout.step_dirname(step)
    return (d / layout.COMPLETE).exists() and not (d / layout.MANIFEST).exists() and \
        any(layout.is_part(p.name) for p in d.iterdir())


def remove_step(root: Path, step: int) -> str:
    """Remove ``step``'s directory from this root only (a commit that reached the other
    nodes but not this one)."""
    shutil.rmtree(root / layout.step_dirname(step))
    return f"removed {layout.step_dirname(step)} from {root.name}"


def wipe(root: Path) -> str:
    """Delete everything in ``root`` (a replaced node's empty disk); the directory, which
    may be a mount point, stays."""
    n = 0
    for e in os.scandir(root):
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path)
        else:
            os.unlink(e.path)
        n += 1
    return f"wiped {root.name} ({n} entries)"


# --- tmpfs ------------------------------------------------------------------------------------

def mount_tmpfs(path: Path, size_bytes: int) -> str | None:
    """Mount a tmpfs of ``size_bytes`` on ``path`` (created); None on success, else why not."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0750",
                            "tmpfs", str(path)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


def unmount(path: Path) -> None:
    """Unmount ``path`` (lazily if busy); quiet when nothing is mounted there."""
    r = subprocess.run(["umount", str(path)], capture_output=True, timeout=30)
    if r.returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def unmount_under(base: Path) -> list[Path]:
    """Unmount every file system mounted at or below ``base`` (a previous drill's), deepest
    first; returns the mount points."""
    base_s = str(base.absolute())
    points = []
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 1:
                mnt = parts[1].replace("\\040", " ")
                if mnt == base_s or mnt.startswith(base_s + "/"):
                    points.append(Path(mnt))
    for p in sorted(points, key=lambda p: len(p.parts), reverse=True):
        unmount(p)
    return points
