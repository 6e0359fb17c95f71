"""The three plain-text tables bench/scaling.py prints (aligned, pasteable into Markdown)."""

from __future__ import annotations

import argparse
from typing import Any

_MIB = float(1 << 20)


def _section(title: str, headers: list[str], lines: list[list[str]], foot: str) -> str:
    """One sweep's printout: what was measured, the table, how to read it."""
    return f"{title}\n\n{_render(headers, lines)}\n\n{foot}"


def _render(headers: list[str], lines: list[list[str]]) -> str:
    """A Markdown table whose columns line up in a terminal as well."""
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]

    def row(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([row(headers), rule, *(row(line) for line in lines)])


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _psi(value: float | None, model_bytes: int) -> str:
    return "n/a" if value is None else f"{value / model_bytes:.2f}"


def world_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = []
    for r in rows:
        mb = r["model_bytes"]
        wire, ideal = r["wire_bytes"], r["ideal_wire_bytes"]
        lines.append(
            [
                r["label"],
                str(r["world_size"]),
                _x(r["ratio_median"]),
                "n/a"
                if r["comm_bytes_per_step"] is None
                else f"{r['comm_bytes_per_step'] / mb:.2f}",
                _psi(wire, mb),
                _psi(ideal, mb),
                "n/a" if wire is None else f"{wire / ideal:.2f}",
            ]
        )
    params = rows[0]["params"] / 1e6 if rows else 0.0
    title = (
        f"world-size sweep: GPT {params:.2f}M params, micro-batch {args.micro_batch} per rank; "
        "bytes in units of Ψ = the model's fp32 bytes"
    )
    headers = [
        "engine",
        "N",
        "step/DDP",
        "full-tensor Ψ",
        "sent/rank Ψ",
        "ideal sent/rank Ψ",
        "sent/ideal",
    ]
    foot = (
        "full-tensor: what the counters see per step (all-reduce tensor, reduce-scatter input,\n"
        "all-gather output), largest rank. sent/rank: those bytes times the ring cost per rank\n"
        "(all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N), rank 0. ideal: the ZeRO\n"
        "paper's 2Ψ(N-1)/N (DDP, stages 0-2) and 3Ψ(N-1)/N (stage 3, FSDP2)."
    )
    return _section(title, headers, lines, foot)


def psi_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = []
    for r in rows:
        state, ideal = r["model_state_bytes"], r["ideal_model_state_bytes"]
        lines.append(
            [
                r["label"],
                r["model"][1:],
                f"{r['params'] / 1e6:.2f}M",
                _x(r["ratio_median"]),
                "n/a" if state is None else f"{state / _MIB:.1f}",
                f"{ideal / _MIB:.1f}",
                "n/a" if state is None else f"{state / ideal:.2f}",
            ]
        )
    headers = ["engine", "layers", "Ψ params", "step/DDP", "state MiB", "ideal MiB", "state/ideal"]
    title = (
        f"model-size sweep: world size 2, d_model 128, micro-batch {args.micro_batch} per rank; "
        "state = this rank's params + grads + optimizer state (largest rank)"
    )
    foot = (
        "ideal: the ZeRO paper's fp32 AdamW figure per rank, 4Ψ params + 4Ψ grads + 8Ψ Adam\n"
        "moments = 16Ψ replicated; stage 1 divides the 8Ψ by N, stage 2 also the grads, stage 3\n"
        "all of it (DDP counted as stage 0, FSDP2 as 3)."
    )
    return _section(title, headers, lines, foot)


def fit_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = []
    for r in rows:
        tried = " ".join(f"{a['depth']}{'+' if a['ok'] else '-'}" for a in r["attempts"])
        lines.append(
            [
                r["label"],
                str(r["max_depth"]),
                f"{r['max_params'] / 1e6:.1f}M",
                _x(r["vs_ddp"]),
                f"{r['ideal_max_params'] / 1e6:.1f}M",
                tried,
            ]
        )
    headers = ["engine", "max layers", "params", "vs DDP", "ideal params", "attempts"]
    title = (
        f"largest GPT that trains 2 steps under RLIMIT_DATA {args.budget_mib} MiB per rank, "
        "world size 2 (d_model 512, 8 heads, seq 32, vocab 1024, micro-batch "
        f"{args.micro_batch})"
    )
    foot = (
        "attempts: depth tried, + trained, - failed, in order (each a fresh pair of processes).\n"
        "ideal params: the budget less ~300 MiB of interpreter and libraries, over the paper's\n"
        "bytes per parameter (16, 8 + 8/N, 4 + 12/N, 16/N): activations and buffers ignored."
    )
    return _section(title, headers, lines, foot)
