"""What the demo shows at the end: the summary table and the loss-curve plot (rank 0 only).

Kept apart from the training script so that the script reads as a training
loop; nothing here runs a collective.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from zerodp.monitor import ModelStateBytes, ideal_model_state_bytes

# DDP with fp32 Adam holds, per parameter: 4 bytes of weights, 4 of gradients, 8 of moments.
_DDP_SPLIT = (4, 4, 8)


@dataclass
class RunStats:
    """Everything the summary table reports, gathered while the script runs."""

    stage: int
    world_size: int
    num_params: int
    state_bytes: ModelStateBytes
    first_train_loss: float
    final_train_loss: float
    first_valid_loss: float
    final_valid_loss: float
    wall_s: float
    train_s: float
    train_tokens: int
    checkpoint: str


def ddp_state_bytes(num_params: int, world_size: int) -> ModelStateBytes:
    """What each DDP rank would hold for the same model and fp32 AdamW (stage 0, replicated)."""
    total = ideal_model_state_bytes(num_params, 0, world_size)
    unit = total // sum(_DDP_SPLIT)
    return ModelStateBytes(*(unit * share for share in _DDP_SPLIT))


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:8.2f} MiB"


def _memory_rows(stats: RunStats) -> list[str]:
    ddp = ddp_state_bytes(stats.num_params, stats.world_size)
    ours = stats.state_bytes
    label = f"ZeRO-{stats.stage} rank"
    rows = [f"  {'model state per rank':<22}{label:>14}{'DDP rank':>14}{'ratio':>8}"]
    pairs = [
        ("parameters", ours.params, ddp.params),
        ("gradients", ours.grads, ddp.grads),
        ("optimizer state", ours.optimizer, ddp.optimizer),
        ("total", ours.total, ddp.total),
    ]
    for name, mine, theirs in pairs:
        ratio = f"{mine / theirs:.2f}x" if theirs else "-"
        rows.append(f"  {name:<22}{_mib(mine):>14}{_mib(theirs):>14}{ratio:>8}")
    return rows


def summary_table(stats: RunStats) -> str:
    """The plain-text, aligned summary printed after training."""
    tokens_per_s = stats.train_tokens / stats.train_s if stats.train_s > 0 else 0.0
    lines = [
        "=" * 60,
        "zerodp GPT demo: summary",
        "=" * 60,
        f"  {'ZeRO stage':<22}{stats.stage}",
        f"  {'world size':<22}{stats.world_size}",
        f"  {'parameters':<22}{stats.num_params:,}",
        "",
        *_memory_rows(stats),
        "",
        f"  {'train loss':<22}{stats.first_train_loss:.3f} (first step) -> "
        f"{stats.final_train_loss:.3f} (last 10 steps)",
        f"  {'validation loss':<22}{stats.first_valid_loss:.3f} (first eval) -> "
        f"{stats.final_valid_loss:.3f} (final eval)",
        f"  {'wall time':<22}{stats.wall_s:.1f} s (training steps {stats.train_s:.1f} s)",
        f"  {'throughput':<22}{tokens_per_s:,.0f} tokens/s over all ranks",
        f"  {'checkpoint':<22}{stats.checkpoint}",
        "=" * 60,
    ]
    return "\n".join(lines)


def read_step_csv(path: Path) -> list[tuple[int, float]]:
    """`step,value` rows of one monitor CSV, limited to the latest run.

    The engine appends to its CSV files, so a file can hold several runs. A
    step that does not exceed the previous one marks a restart (a fresh run
    starts over; a resumed run continues from its checkpoint): rows at or
    after that step from before it are dropped, leaving one consistent curve.
    """
    rows: list[tuple[int, float]] = []
    with path.open(newline="", encoding="utf-8") as handle:
        for record in csv.DictReader(handle):
            step, value = int(record["step"]), float(record["value"])
            while rows and rows[-1][0] >= step:
                rows.pop()
            rows.append((step, value))
    return rows


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    out: list[float] = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_losses(
    train_csv: Path,
    valid_points: Sequence[tuple[int, float]],
    samples_per_step: int,
    out_path: Path,
) -> str:
    """Draw train loss (from the engine's CSV) and validation loss against optimizer steps.

    Returns a one-line note of what was written or why it was skipped: the
    plot is a convenience and must never fail the run it reports on.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; skipped the loss-curve plot"
    if not train_csv.exists():
        return f"no train-loss log at {train_csv}; skipped the loss-curve plot"
    # The engine logs DeepSpeed-style, with the sample count as the x value.
    rows = read_step_csv(train_csv)
    steps = [step / samples_per_step for step, _ in rows]
    losses = [loss for _, loss in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="train (per step)")
    ax.plot(steps, _moving_average(losses, 20), color="tab:blue", label="train (mean of 20)")
    if valid_points:
        ax.plot(*zip(*valid_points, strict=True), "o-", color="tab:orange", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title("zerodp GPT demo on the Python standard library")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return f"loss curve written to {out_path}"
