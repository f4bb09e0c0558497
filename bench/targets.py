"""The issue's targets as pure functions of measured numbers (no I/O, no torch).

Each target compares one subject's figure with a limit measured in the same run (or with
the same loop idle) and says met / missed. Every subject is evaluated, peers included, so
the table shows how far plain DCP is from each goal next to tierckpt. A target whose
inputs are missing (a skipped section, a limit the machine refused) is ``met: None`` with
the reason in ``note``; a figure from a read that was not cold says so too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

Section = dict[str, Any]
Ratio = Callable[[Section, dict[str, Any]], float | None]


@dataclass(frozen=True)
class Goal:
    """A target: ``ratio op threshold`` must hold; ``text`` is how the table says it."""

    key: str
    text: str
    op: str  # "<=" or ">="
    threshold: float
    ratio: Ratio
    subjects: tuple[tuple[str, str, str], ...]  # (section, entry, label)
    also: Callable[[Section], str | None] = lambda entry: None  # a second condition's miss


def _seconds(m: dict[str, Any] | None) -> float | None:
    return m["seconds"] if m and m.get("seconds", 0) > 0 else None


def _gbps(m: dict[str, Any] | None) -> float | None:
    return m["gbps"] if m and m.get("gbps", 0) > 0 else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _blocking(entry: Section, limits: dict[str, Any]) -> float | None:
    return _div(_seconds(entry), _seconds(limits.get("copy_2threads")))


def _durable(entry: Section, limits: dict[str, Any]) -> float | None:
    return _div(_gbps(entry), _gbps(limits.get("write_odirect_fsync")))


def _restore(entry: Section, limits: dict[str, Any]) -> float | None:
    return _div(_gbps(entry), _gbps(limits.get("cold_read")))


def _throughput(entry: Section, limits: dict[str, Any]) -> float | None:
    return entry.get("ratio")


def _vs_boto3(entry: Section, limits: dict[str, Any]) -> float | None:
    return entry.get("ratio_vs_boto3")  # boto3 ran in the transfer section, not in limits


def _ram(entry: Section, limits: dict[str, Any]) -> float | None:
    return entry.get("ratio")


def _vs_best(kind: str) -> Ratio:
    def ratio(entry: Section, limits: dict[str, Any]) -> float | None:
        value = entry.get(kind, {}).get("ratio_vs_best")
        return float(value) if value is not None else None
    return ratio


_TIER2_STORES = (("tier2_servers", "seaweedfs", "S3 on SeaweedFS"),
                 ("tier2_servers", "moto", "S3 on moto"),
                 ("tier2_servers", "fake_gcs", "GCS on fake-gcs-server"),
                 ("tier2_servers", "azurite", "Azure on Azurite"))
"""The tier-2 clients' section (``bench/tier2_servers.py``): one subject per store."""

_GROWTH_OK = 0.05


def _ram_growth(entry: Section) -> str | None:
    growth = entry.get("growth_ratio", 0.0)
    if growth > _GROWTH_OK:
        return f"grew by {growth:.0%} of the state between the first and last save"
    return None


GOALS: tuple[Goal, ...] = (
    Goal("blocking", "blocking time C ≤ 1.2× the 2-thread copy limit", "<=", 1.2, _blocking,
         (("dcp", "async_default_blocking", "dcp.async_save default"),
          ("dcp", "async_stager_blocking", "dcp.async_save + reused DefaultStager"),
          ("tierckpt", "blocking", "tierckpt save()"))),
    Goal("overlap", "C with staging overlapped ≤ 0.1× the copy limit (compute > copy)",
         "<=", 0.1, _blocking,
         (("tierckpt", "blocking_overlap", "tierckpt save(), staging='overlap'"),)),
    Goal("durable", "durable write ≥ 0.9× the O_DIRECT+fsync limit", ">=", 0.9, _durable,
         (("dcp", "save_t1", "dcp.save thread_count=1"),
          ("dcp", "save_t4", "dcp.save thread_count=4"),
          ("dcp", "torch_save_rank0", "torch.save gathered on rank 0"),
          ("dcp", "async_default_durable", "dcp.async_save default, until done"),
          ("tierckpt", "durable", "tierckpt save() → committed"))),
    Goal("restore", "cold restore ≥ 0.95× the cold-read limit", ">=", 0.95, _restore,
         (("dcp", "load_cold", "dcp.load"), ("tierckpt", "restore_cold", "tierckpt restore()"))),
    Goal("throughput", "training throughput during a save ≥ 0.8× idle", ">=", 0.8, _throughput,
         (("dcp", "throughput", "during dcp.async_save"),
          ("tierckpt", "throughput", "during tierckpt save()"),
          ("tierckpt", "throughput_overlap", "during tierckpt save(), staging='overlap'"))),
    Goal("ram", "extra host RAM ≤ 1.0× the state, no growth over the saves", "<=", 1.0, _ram,
         (("dcp", "ram_thread", "dcp.async_save thread mode"),
          ("dcp", "ram_process", "dcp.async_save process mode"),
          ("tierckpt", "ram", "tierckpt save()")), also=_ram_growth),
    Goal("upload", "upload ≥ 0.9× a plain boto3 transfer", ">=", 0.9, _vs_boto3,
         (("transfer", "tierckpt_upload", "tierckpt upload"),)),
    Goal("download", "download ≥ 0.9× a plain boto3 transfer", ">=", 0.9, _vs_boto3,
         (("transfer", "tierckpt_download", "tierckpt fetch"),)),
    Goal("upload_throughput", "training throughput while uploading ≥ 0.9× idle", ">=", 0.9,
         _throughput, (("transfer", "throughput_uploading", "during tierckpt upload"),)),
    Goal("store_upload", "upload ≥ 0.9× the best other client on the store", ">=", 0.9,
         _vs_best("upload"), _TIER2_STORES),
    Goal("store_fetch", "fetch ≥ 0.9× the best other client on the store", ">=", 0.9,
         _vs_best("download"), _TIER2_STORES),
)

# What a tierckpt figure is compared with in the "vs DCP" column: the default peer.
DCP_REFERENCE = {"blocking": "async_default_blocking", "overlap": "async_default_blocking",
                 "durable": "save_t1",
                 "restore": "load_cold", "throughput": "throughput", "ram": "ram_thread",
                 "upload": "", "download": "", "upload_throughput": "", "store_upload": "",
                 "store_fetch": ""}


@dataclass(frozen=True)
class Verdict:
    """One subject against one goal at one world size."""

    goal: str
    text: str
    world: int
    subject: str
    ratio: float | None
    op: str
    threshold: float
    met: bool | None
    vs_dcp: float | None
    note: str

    def to_json(self) -> dict[str, Any]:
        """Plain dict for the results file."""
        return asdict(self)


def _note(entry: Section | None, section: Section) -> str:
    if entry is None:
        return section.get("skipped", "not measured")
    if "skipped" in entry:
        return str(entry["skipped"])
    if entry.get("cold") is False:
        return "page cache not dropped: this read was warm"
    return ""


def limits_for(limits: dict[str, Any], world: int) -> dict[str, Any]:
    """The limits a world-``world`` figure is held to: its ranks share one disk, so its
    cold-read limit is the concurrent one (``cold_read_x<world>``) where it was measured."""
    concurrent = limits.get(f"cold_read_x{world}")
    return {**limits, "cold_read": concurrent} if concurrent else limits


def _verdicts(goal: Goal, world: int, sections: dict[str, Section],
              limits: dict[str, Any]) -> list[Verdict]:
    limits = limits_for(limits, world)
    out = []
    dcp_ref = sections.get("dcp", {}).get(DCP_REFERENCE.get(goal.key, ""))
    for section_name, entry_name, label in goal.subjects:
        section = sections.get(section_name, {})
        entry = section.get(entry_name)
        ratio = goal.ratio(entry, limits) if entry and "skipped" not in entry else None
        met = None if ratio is None else (
            ratio <= goal.threshold if goal.op == "<=" else ratio >= goal.threshold)
        note = _note(entry, section)
        miss = goal.also(entry) if entry and ratio is not None else None
        if miss:
            met, note = False, miss
        vs_dcp = None
        if section_name == "tierckpt" and ratio is not None and dcp_ref:
            vs_dcp = _div(ratio, goal.ratio(dcp_ref, limits))
        out.append(Verdict(goal.key, goal.text, world, label, ratio, goal.op, goal.threshold,
                           met, vs_dcp, note))
    return out


def evaluate(limits: dict[str, Any], worlds: dict[int, dict[str, Section]],
             shared: dict[str, Section] | None = None) -> list[Verdict]:
    """Every goal × subject × world size; ``worlds[w][section][entry]`` as in the results.

    Goals whose subjects all live in ``shared`` (run-wide sections such as ``transfer``)
    are evaluated once, with ``world`` 0.
    """
    shared = shared or {}
    out = []
    for goal in GOALS:
        if all(section in shared for section, _, _ in goal.subjects):
            out += _verdicts(goal, 0, shared, limits)
            continue
        for world, sections in sorted(worlds.items()):
            out += _verdicts(goal, world, sections, limits)
    return out
