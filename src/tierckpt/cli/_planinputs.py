"""The planning inputs C, R, W and M from flags, an event log or a drill report, each with a
note of where it came from ("given", or how it was measured). Shared by ``plan`` and
``simulate``; errors name the flag to fix."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tierckpt.errors import ConfigError
from tierckpt.policy import plan
from tierckpt.policy.units import format_duration, parse_duration
from tierckpt.runtime import measure

GIVEN = "given"


@dataclass(frozen=True, kw_only=True)
class Inputs:
    """Resolved inputs in seconds; C, R or W is None when neither given nor measured."""

    C: float | None
    R: float | None
    W: float | None
    M: float
    node_mtbf: float | None
    nodes: int | None
    sources: dict[str, str] = field(default_factory=dict)


def resolve(*, blocking: str | None, restart: str | None, write_time: str | None,
            job_mtbf: str | None, node_mtbf: str | None, nodes: int | None,
            from_events: Path | None = None, from_drill: Path | None = None) -> Inputs:
    """Flags win over measurements; a drill report wins over an event log for what it has."""
    if nodes is not None and nodes < 1:
        raise ConfigError(f"--nodes must be a positive integer, got {nodes}")
    m = _measurements(from_events, from_drill)
    sources: dict[str, str] = {}
    values: dict[str, float | None] = {}
    for key, flag, text, measured, zero_ok in (
            ("C_s", "--blocking", blocking, m.C, False),
            ("R_s", "--restart", restart, m.R, True),
            ("W_s", "--write-time", write_time, m.W, True)):
        if text is not None:
            values[key] = parse_duration(text, flag, allow_zero=zero_ok)
            sources[key] = GIVEN
        elif measured is not None:
            if measured.seconds <= 0 and not zero_ok:
                raise ConfigError(f"{flag}: the measured value is {measured.seconds} s "
                                  f"({measured.source}); give {flag} instead")
            values[key] = measured.seconds
            sources[key] = f"measured: {measured.source}"
        else:
            values[key] = None
    if job_mtbf is not None and node_mtbf is not None:
        raise ConfigError("give either --job-mtbf or --node-mtbf with --nodes, not both")
    if job_mtbf is not None:
        M = parse_duration(job_mtbf, "--job-mtbf")
        sources["job_mtbf_s"] = GIVEN
        node = M * nodes if nodes is not None else None
    elif node_mtbf is not None:
        node = parse_duration(node_mtbf, "--node-mtbf")
        if nodes is None:
            raise ConfigError("--node-mtbf needs --nodes (job MTBF = node MTBF / nodes)")
        M = plan.job_mtbf(node, nodes)
        sources["job_mtbf_s"] = f"--node-mtbf / --nodes ({format_duration(node)} / {nodes})"
    else:
        raise ConfigError("missing MTBF: give --job-mtbf, or --node-mtbf with --nodes")
    C = values["C_s"]
    if C is not None and C >= M:
        raise ConfigError(f"--blocking ({format_duration(C)}) must be smaller than the job MTBF "
                          f"({format_duration(M)}): saves cannot keep up with failures")
    return Inputs(C=C, R=values["R_s"], W=values["W_s"], M=M, node_mtbf=node, nodes=nodes,
                  sources=sources)


def require(value: float | None, flag: str) -> float:
    """``value`` or a ConfigError telling the user to give ``flag`` or a measurement."""
    if value is None:
        raise ConfigError(f"missing {flag}: give {flag}, or --from-events / --from-drill "
                          "with a measurement of it")
    return value


def _measurements(events: Path | None, drill: Path | None) -> measure.Measurements:
    ev = measure.from_event_log(events) if events is not None else measure.Measurements()
    if drill is None:
        return ev
    dr = measure.from_drill_report(drill)
    return measure.Measurements(C=dr.C or ev.C, W=dr.W or ev.W, R=dr.R or ev.R)
