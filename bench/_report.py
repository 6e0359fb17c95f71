"""Rows of results, the printed table and the JSON file.

Ratios are to DDP's figures for the same model in the same run, because
absolute step times on a shared VM move between runs while ratios measured
interleaved mostly do not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from bench._engines import EngineSpec
from zerodp.monitor import ModelStateBytes

_MIB = float(1 << 20)


@dataclass(frozen=True)
class Measured:
    """One engine's bytes: totals from the rank holding most, breakdowns from this rank."""

    state: ModelStateBytes | None
    state_bytes: int | None
    comm_bytes: int | None
    comm_by_kind: dict[str, dict[str, int]]


@dataclass
class Row:
    spec: EngineSpec
    model: str
    params: int
    steps: int
    samples_s: list[float]
    median_s: float
    min_s: float
    ideal_bytes: int
    measured: Measured
    ratio_median: float | None = None
    ratio_min: float | None = None


def fill_ratios(rows: list[Row]) -> None:
    """Each row's median and min over DDP's, same model; None when DDP was not run."""
    ddp = {r.model: r for r in rows if r.spec.engine == "ddp"}
    for row in rows:
        base = ddp.get(row.model)
        if base is not None:
            row.ratio_median = row.median_s / base.median_s
            row.ratio_min = row.min_s / base.min_s


def _mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / _MIB:.1f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


_COLUMNS = (
    ("engine", "<"),
    ("stage", ">"),
    ("model", "<"),
    ("params", ">"),
    ("median ms", ">"),
    ("min ms", ">"),
    ("med/DDP", ">"),
    ("min/DDP", ">"),
    ("state MiB", ">"),
    ("ideal MiB", ">"),
    ("comm MiB/step", ">"),
)


def _engine_cell(row: Row) -> str:
    notes = [] if row.spec.check_order else ["no order check"]
    notes += [] if row.spec.stall_checks else ["no stall checks"]
    notes += [f"units: {row.spec.units}"] if row.spec.units else []
    return f"{row.spec.engine} ({', '.join(notes)})" if notes else row.spec.engine


def _cells(row: Row) -> list[str]:
    return [
        _engine_cell(row),
        str(row.spec.stage),
        row.model,
        f"{row.params / 1e6:.2f}M",
        f"{row.median_s * 1e3:.1f}",
        f"{row.min_s * 1e3:.1f}",
        _ratio(row.ratio_median),
        _ratio(row.ratio_min),
        _mib(row.measured.state_bytes),
        _mib(row.ideal_bytes),
        _mib(row.measured.comm_bytes),
    ]


def format_table(rows: list[Row]) -> str:
    """Plain aligned text: readable in a terminal, a log file and a pasted issue alike."""
    table = [[name for name, _ in _COLUMNS], *(_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]

    def render(line: list[str]) -> str:
        parts = []
        for text, width, (_, align) in zip(line, widths, _COLUMNS, strict=True):
            parts.append(text.ljust(width) if align == "<" else text.rjust(width))
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([render(table[0]), rule, *(render(line) for line in table[1:])])


def row_json(row: Row, world_size: int) -> dict[str, Any]:
    state = row.measured.state
    return {
        "engine": row.spec.engine,
        "stage": row.spec.stage,
        "model": row.model,
        "median_s": row.median_s,
        "min_s": row.min_s,
        "ratio_median": row.ratio_median,
        "ratio_min": row.ratio_min,
        "model_state_bytes": row.measured.state_bytes,
        "ideal_model_state_bytes": row.ideal_bytes,
        "comm_bytes_per_step": row.measured.comm_bytes,
        "label": row.spec.label,
        "params": row.params,
        "world_size": world_size,
        "steps_per_repeat": row.steps,
        "samples_s": row.samples_s,
        "model_state_breakdown_rank0": (
            None
            if state is None
            else {"params": state.params, "grads": state.grads, "optimizer": state.optimizer}
        ),
        "comm_by_kind_rank0": row.measured.comm_by_kind,
    }


def write_json(path: str, rows: list[Row], world_size: int) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump([row_json(r, world_size) for r in rows], handle, indent=2)
        handle.write("\n")
