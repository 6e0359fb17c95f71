"""The tables and the plot of bench/expert_parallel.py, from its saved results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MiB = 1 << 20
TRAFFIC = ("expert_gathers", "other_gathers", "reductions", "token_all_to_all")
TRAFFIC_TITLES = {
    "expert_gathers": "expert gathers",
    "other_gathers": "other gathers",
    "reductions": "gradient reductions",
    "token_all_to_all": "token all-to-alls",
}


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MiB:.2f}"


def _engine_title(engine: str) -> str:
    kind, _, size = engine.partition("-ep")
    title = {
        "plain": "plain data parallel (floor)",
        "zerodp": "zerodp stage 3",
        "autoep": "DeepSpeed AutoEP stage 3",
    }[kind]
    return f"{title}, EP {size}" if size else title


def side_by_side_table(saved: dict[str, Any]) -> str:
    """Per world size: memory, bytes per step and step time (AdamW), then exactness."""
    model = saved["model"]
    lines = [
        f"Qwen3-MoE, {model['layers']} layers, hidden {model['hidden']}, {model['experts']} "
        f"experts of width {model['moe_intermediate']}, top-{model['top_k']}: "
        f"{saved['params'] / 1e6:.2f} M parameters, {saved['expert_params'] / 1e6:.2f} M "
        f"in experts; fp32, gradients clipped at norm 1; "
        f"{', '.join(f'{k} {v}' for k, v in saved['versions'].items())}",
    ]
    if "load_average" in saved:
        loads = ", ".join(f"{x:.1f}" for x in saved["load_average"])
        lines.append(f"Load average (1 min) at the start and after each part: {loads}")
    for run in saved.get("compare", []):
        lines += ["", *_memory_rows(run, saved), "", *_exactness_rows(run, saved)]
        autoep = run.get("autoep")
        if autoep and autoep["unpatched_error"]:
            lines += [
                "",
                f"DeepSpeed AutoEP as shipped, W={run['world']}: {autoep['unpatched_error']}",
                f"Its rows ran with the bench's patch: {autoep['patch']}",
            ]
    return "\n".join(lines)


def _memory_rows(run: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    rows = [r for r in run["rows"] if r["pass"] == "timed"]
    base = next(r for r in rows if r["engine"] == "zerodp")
    lines = [
        f"W={run['world']}, AdamW, {saved['timed_steps']} steps: model states and bytes per "
        f"rank (MiB; bytes per step the median after {saved['warmup']} steps, the rank with "
        "most), step time (ms, slowest rank; median and fastest after the warm-up)",
        "",
        "| engine | model states | of which experts | "
        + " | ".join(f"{TRAFFIC_TITLES[k]} per step" for k in TRAFFIC)
        + " | most gathered at once | step, median | fastest | median, x zerodp stage 3 |",
        "|---|---|---|" + "---|" * len(TRAFFIC) + "---|---|---|---|",
    ]
    for r in rows:
        traffic = " | ".join(_mib(r["traffic"][k]) for k in TRAFFIC)
        lines.append(
            f"| {_engine_title(r['engine'])} | {_mib(r['state_bytes'])} | "
            f"{_mib(r['expert_state_bytes'])} | {traffic} | {_mib(r['peak_gathered_bytes'])} | "
            f"{1000 * r['median_s']:.0f} | {1000 * r['min_s']:.0f} | "
            f"{r['median_s'] / base['median_s']:.2f} |"
        )
    return lines


def _exactness_rows(run: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    lines = [
        f"W={run['world']}, {saved['steps']} steps: against one process on the same data",
        "",
        "| engine | optimizer | weights, largest difference while every token is routed "
        "as in one process | weights after the last step | losses, largest difference "
        "| tokens x layers routed otherwise (first at step) |",
        "|---|---|---|---|---|---|",
    ]
    for r in run["rows"]:
        if r["pass"] != "exact":
            continue
        first = r["first_rerouted_step"]
        alike = r["weights_while_routed_alike"]
        steps = len(r["rerouted_by_step"]) if first is None else first
        alike_text = "-" if alike is None else f"{alike:.1e} ({steps} steps)"
        where = "" if first is None else f" (step {first})"
        lines.append(
            f"| {_engine_title(r['engine'])} | {r['optimizer']} | {alike_text} | "
            f"{r['weights']:.1e} | {r['loss_difference']:.1e} | "
            f"{r['rerouted']} of {r['routed']}{where} |"
        )
    return lines


def per_expert_slope(result: dict[str, Any]) -> tuple[float, float] | None:
    """(what one more expert per layer adds to a rank's peak resident memory, the peak rise
    without experts): the least-squares line through the attempts that fit, the peak rise
    being VmHWM's above the process before the model (the rank with most)."""
    points = [
        (a["experts"], a["vmhwm_bytes"] - a["before_vmhwm_bytes"])
        for a in result["attempts"]
        if a["ok"]
    ]
    if len({x for x, _ in points}) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return slope, mean_y - slope * mean_x


def fit_table(saved: dict[str, Any]) -> str:
    lines = [
        f"Experts per byte: the most experts per layer that train 2 AdamW steps with "
        f"{saved['budget_mib']:g} MiB per rank beyond the process before the model "
        "(the whole model built on each rank, the engine and the steps inside it)",
        "",
        "| W | engine | most experts per layer | peak rise per rank at that size (MiB) "
        "| per expert (MiB) | without experts (MiB) | attempts |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in saved["fit"]:
        best = [a for a in r["attempts"] if a["ok"] and a["experts"] == r["most_experts"]]
        peak = best[0]["vmhwm_bytes"] - best[0]["before_vmhwm_bytes"] if best else None
        line = per_expert_slope(r)
        slope, fixed = (None, None) if line is None else line
        most = f"{r['most_experts']}" + (" (limit)" if r["capped"] else "")
        lines.append(
            f"| {r['world']} | {_engine_title(r['engine'])} | {most} | {_mib(peak)} | "
            f"{_mib(slope)} | {_mib(fixed)} | {len(r['attempts'])} |"
        )
    return "\n".join(lines)


def plot(saved: dict[str, Any], directory: str) -> Path | None:
    """Bytes per step by purpose (AdamW) and the most experts that fit, per world size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = saved.get("compare", [])
    if not runs:
        return None
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels, bottoms = [], []
    for run in runs:
        for r in run["rows"]:
            if r["pass"] == "timed" and r["engine"] != "plain":
                labels.append(f"W{run['world']} {r['engine']}")
                bottoms.append(r["traffic"])
    base = [0.0] * len(labels)
    for key in TRAFFIC:
        values = [t[key] / MiB for t in bottoms]
        left.bar(range(len(labels)), values, bottom=base, label=TRAFFIC_TITLES[key])
        base = [b + v for b, v in zip(base, values, strict=True)]
    left.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    left.set_ylabel("MiB per step, the rank with most")
    left.set_title("Bytes per step (AdamW)")
    left.legend(fontsize=8)
    fits = saved.get("fit", [])
    names = [f"W{r['world']} {r['engine']}" for r in fits]
    right.bar(range(len(fits)), [r["most_experts"] for r in fits], color="tab:green")
    right.set_xticks(range(len(fits)), names, rotation=30, ha="right", fontsize=8)
    right.set_ylabel("experts per layer")
    right.set_title(f"Most experts in {saved['budget_mib']:g} MiB per rank")
    figure.tight_layout()
    path = Path(directory) / "expert_parallel.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path
