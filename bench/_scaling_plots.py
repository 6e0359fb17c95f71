"""PNG plots of bench/scaling.py's sweeps (matplotlib, from the `demo` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_MIB = float(1 << 20)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _by_label(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(row["label"], []).append(row)
    return out


def plot_world(rows: list[dict[str, Any]], path: Path) -> None:
    plt = _pyplot()
    fig, (ax_t, ax_c) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, group in _by_label(rows).items():
        ns = [r["world_size"] for r in group]
        ax_t.plot(ns, [r["ratio_median"] for r in group], marker="o", label=label)
        sent = [
            (r["world_size"], r["wire_bytes"] / r["model_bytes"]) for r in group if r["wire_bytes"]
        ]
        if sent:
            ax_c.plot(*zip(*sent, strict=True), marker="o", linestyle="none", label=label)
    ns = sorted({r["world_size"] for r in rows})
    fine = [n / 10 for n in range(int(ns[0] * 10), int(ns[-1] * 10) + 1)]
    ax_c.plot(fine, [2 * (n - 1) / n for n in fine], "k--", label="ideal 2Ψ(N-1)/N")
    ax_c.plot(fine, [3 * (n - 1) / n for n in fine], "k:", label="ideal 3Ψ(N-1)/N")
    ax_t.set(xlabel="world size N", ylabel="step time / DDP (median)", title="step time vs DDP")
    ax_c.set(xlabel="world size N", ylabel="bytes sent per rank per step / Ψ", title="traffic")
    for ax in (ax_t, ax_c):
        ax.set_xticks(ns)
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=7, ncol=2)
    ax_c.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_psi(rows: list[dict[str, Any]], path: Path) -> None:
    plt = _pyplot()
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, group in _by_label(rows).items():
        ps = [r["params"] / 1e6 for r in group]
        line = None
        if all(r["model_state_bytes"] for r in group):
            (line,) = ax_m.plot(
                ps, [r["model_state_bytes"] / _MIB for r in group], marker="o", label=label
            )
        if line is not None and label.startswith("zerodp"):
            ideal = [r["ideal_model_state_bytes"] / _MIB for r in group]
            ax_m.plot(ps, ideal, linestyle="--", color="black", linewidth=0.8, zorder=3)
        ax_t.plot(ps, [r["ratio_median"] for r in group], marker="o", label=label)
    ax_m.set(
        xscale="log",
        yscale="log",
        xlabel="parameters Ψ (millions)",
        ylabel="model state per rank (MiB)",
        title="model state (black dashes: ZeRO paper, per stage)",
    )
    ax_t.set(xscale="log", xlabel="parameters Ψ (millions)", ylabel="step time / DDP (median)")
    ax_t.set_title("step time vs DDP")
    ticks = sorted({r["params"] / 1e6 for r in rows})
    for ax in (ax_m, ax_t):
        ax.set_xticks(ticks, [f"{t:.2f}" for t in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_fit(rows: list[dict[str, Any]], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    labels = [r["label"] for r in rows]
    xs = range(len(rows))
    ax.bar(xs, [r["max_params"] / 1e6 for r in rows], color="tab:blue", label="trains")
    ax.plot(
        xs, [r["ideal_max_params"] / 1e6 for r in rows], "k_", markersize=28, label="paper's bound"
    )
    for x, r in zip(xs, rows, strict=True):
        ax.annotate(
            f"{r['max_depth']} layers", (x, r["max_params"] / 1e6), ha="center", va="bottom"
        )
    ax.set_xticks(list(xs), labels, rotation=20)
    ax.set(ylabel="parameters (millions)", title="largest GPT under the per-rank memory cap, N=2")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_plots(results: dict[str, Any], directory: Path) -> list[Path]:
    """One PNG per sweep present in `results`; the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for part, draw in (("world", plot_world), ("psi", plot_psi), ("fit", plot_fit)):
        if results.get(part):
            path = directory / f"scaling_{part}.png"
            draw(results[part], path)
            written.append(path)
    return written
