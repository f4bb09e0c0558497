"""``tierckpt plan --notice 30s``: is a grace period enough for the emergency save to reach
each tier? The inputs come from flags or a run's events (flags win), each with its source;
the chain is :func:`tierckpt.policy.notice.plan`; the verdict names the grace each tier
needs and how to ask a scheduler for it. Errors name the flag to fix."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from tierckpt.cli._render import console
from tierckpt.errors import ConfigError
from tierckpt.policy import notice as noticelib
from tierckpt.policy.units import (
    format_bytes,
    format_duration,
    format_rate,
    parse_duration,
    parse_rate,
    parse_size,
)
from tierckpt.runtime import events as ev
from tierckpt.runtime import rates

MARGIN_S = 2.0
"""The default ``--margin``: :attr:`tierckpt.preempt.config.Preemption.margin_s`'s default."""

_HOW = {
    "tier0": "--tier0-rate (e.g. 5GB/s), or --tier1 DIR of a run with tier 0 on",
    "tier1": "--tier1-rate (e.g. 1GB/s), or --tier1 DIR of a run that saved",
    "tier2": "--tier2-rate (e.g. 200MB/s), or --tier1 DIR of a run that uploaded",
}


@dataclass(frozen=True, kw_only=True)
class NoticeInputs:
    """The chain's inputs; a rate is None where neither given nor measured."""

    nbytes: int
    tiers: tuple[str, ...]
    rates_bps: dict[str, float | None]
    stop_s: float
    stage_s: float
    margin_s: float
    sources: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def resolve(*, events_path: Path | None, size: str | None, tier0_rate: str | None,
            tier1_rate: str | None, tier2_rate: str | None, step_time: str | None,
            blocking: str | None, margin: str | None) -> NoticeInputs:
    """Flags win over what ``events_path`` measured. Tier 0 is in the chain when its rate is
    given or measured (the run had it on); tiers 1 and 2 always are."""
    m = rates.ChainMeasurements()
    if events_path is not None:
        try:
            m = rates.measure_chain(ev.read_events(events_path))
        except OSError as e:
            raise ConfigError(f"cannot read the events {str(events_path)!r}: {e}") from None
    sources: dict[str, str] = {}
    notes: list[str] = []

    def pick(key: str, text: str | None, parse: Any, sample: rates.Sample | None
             ) -> float | None:
        if text is not None:
            sources[key] = "given"
            return float(parse(text))
        if sample is not None:
            sources[key] = f"measured: {sample.source}"
            return sample.value
        return None

    nbytes = pick("bytes_per_node", size, lambda t: parse_size(t, "--size-per-node"), m.nbytes)
    if nbytes is None:
        raise ConfigError("missing the checkpoint size: give --size-per-node (e.g. 80GB, what "
                          "each node writes), or --tier1 DIR of a run that saved")
    rates_bps: dict[str, float | None] = {}
    for tier, text in (("tier0", tier0_rate), ("tier1", tier1_rate), ("tier2", tier2_rate)):
        rates_bps[tier] = pick(f"{tier}_rate", text,
                               lambda t, tier=tier: parse_rate(t, f"--{tier}-rate"),
                               m.rates.get(tier))
    stop = pick("stop_s", step_time, lambda t: parse_duration(t, "--step-time"), m.step_s)
    if stop is None:
        notes.append("one step's time is unknown and counted as 0 s: give --step-time (the "
                      "loop stops at the end of the step it is in)")
    stage = pick("stage_s", blocking, lambda t: parse_duration(t, "--blocking"), m.stage_s)
    if stage is None:
        notes.append("the blocking copy (C) is unknown and counted as 0 s: give --blocking")
    margin_s = MARGIN_S if margin is None else parse_duration(margin, "--margin",
                                                             allow_zero=True)
    sources["margin_s"] = "default (Preemption.margin_s)" if margin is None else "given"
    tiers = tuple(t for t in noticelib.TIERS if t != "tier0" or rates_bps["tier0"])
    return NoticeInputs(nbytes=round(nbytes), tiers=tiers, rates_bps=rates_bps,
                        stop_s=stop or 0.0, stage_s=stage or 0.0, margin_s=margin_s,
                        sources=sources, notes=notes)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _ask(seconds: float) -> str:
    s = math.ceil(seconds)
    return f"ask for --signal=B:USR1@{s} or terminationGracePeriodSeconds: {s}"


def verdict(p: noticelib.NoticePlan) -> str:
    """One line: the most durable tier ``p`` reaches, what the next one needs and how to
    ask for it."""
    g = f"{p.grace_s:g} s"
    reached = p.durable
    head = f"{g} reaches {reached.replace('tier', 'tier ')}" if reached else \
        f"{g} reaches no tier"
    missed = [link for link in p.links if not link.reached]
    if not missed:
        return f"{head}, every tier of the chain (it needs {math.ceil(p.needed_s)} s)"
    first = missed[0]
    name = first.tier.replace("tier", "tier ")
    if not math.isfinite(first.end_s):
        return f"{head}; {name}: rate unknown: give {_HOW[first.tier]}"
    need = first.end_s + p.margin_s
    return f"{head}; {name} needs {math.ceil(need)} s: {_ask(need)}"


def report(grace: list[str], inputs: NoticeInputs) -> dict[str, Any]:
    """The ``--json`` document's ``notice`` object: the inputs, their sources, and per
    grace period the chain, its verdict and the grace every tier needs."""
    plans = []
    for text in grace:
        g = parse_duration(text, "--notice")
        p = noticelib.plan(inputs.nbytes, grace_s=g, tiers=inputs.tiers,
                           rates_bps=inputs.rates_bps, stop_s=inputs.stop_s,
                           stage_s=inputs.stage_s, margin_s=inputs.margin_s)
        plans.append({
            "grace_s": g, "durable": p.durable, "needed_s": _finite(p.needed_s),
            "verdict": verdict(p),
            "links": [{"tier": link.tier, "start_s": _finite(link.start_s),
                       "end_s": _finite(link.end_s),
                       "needed_s": _finite(link.end_s + inputs.margin_s),
                       "reached": link.reached, "why": link.why} for link in p.links],
        })
    unknown = [f"{t}: rate unknown: give {_HOW[t]}" for t in inputs.tiers
               if not inputs.rates_bps.get(t)]
    return {
        "inputs": {"bytes_per_node": inputs.nbytes, "tiers": list(inputs.tiers),
                   "rates_bps": {t: inputs.rates_bps.get(t) for t in inputs.tiers},
                   "stop_s": inputs.stop_s, "stage_s": inputs.stage_s,
                   "margin_s": inputs.margin_s},
        "sources": inputs.sources,
        "plans": plans,
        "unknown": unknown,
        "notes": inputs.notes,
    }


def render(doc: dict[str, Any]) -> None:
    """Print the inputs, one table per grace period, and its verdict."""
    out = console()
    inp, src = doc["inputs"], doc["sources"]
    out.print(f"emergency save of {format_bytes(inp['bytes_per_node'])} per node "
              f"[dim]({src.get('bytes_per_node', 'given')})[/]")
    out.print(f"stop ≤ one step {format_duration(inp['stop_s'])}"
              + (f" [dim]({src['stop_s']})[/]" if "stop_s" in src else "")
              + f", stage (C) {format_duration(inp['stage_s'])}"
              + (f" [dim]({src['stage_s']})[/]" if "stage_s" in src else "")
              + f", margin {format_duration(inp['margin_s'])}")
    for tier in inp["tiers"]:
        rate = inp["rates_bps"][tier]
        shown = format_rate(rate) if rate else "[yellow]unknown[/]"
        out.print(f"{tier.replace('tier', 'tier ')} rate {shown}"
                  + (f" [dim]({src[tier + '_rate']})[/]" if tier + "_rate" in src else ""))
    for p in doc["plans"]:
        t = Table(title=f"notice with {p['grace_s']:g} s of grace", title_justify="left")
        for col, just in (("tier", "left"), ("start", "right"), ("end", "right"),
                          ("needs", "right"), ("reached", "left"), ("why not", "left")):
            t.add_column(col, justify=just)  # type: ignore[arg-type]
        for link in p["links"]:
            def sec(x: float | None) -> str:
                return "—" if x is None else f"{x:.1f} s"
            t.add_row(link["tier"].replace("tier", "tier "), sec(link["start_s"]),
                      sec(link["end_s"]), sec(link["needed_s"]),
                      "[green]yes[/]" if link["reached"] else "[red]no[/]", link["why"])
        out.print(t)
        out.print(f"[bold]{p['verdict']}[/]")
    for line in doc["unknown"]:
        out.print(f"[yellow]unknown:[/] {line}")
    for line in doc["notes"]:
        out.print(f"[yellow]note:[/] {line}")
