"""What the engine writes to its monitors, and the Hessian eigenvalue it estimates.

The CSV rows are checked against the values the training loop saw on every rank (the
window's loss averaged over ranks, the learning rate, the gradient norm); the eigenvalue
against the exact top eigenvalue of a quadratic's mean Hessian.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyNet, tiny_inputs


def _rows(path: Path) -> list[tuple[int, float]]:
    with path.open() as file:
        reader = csv.reader(file)
        assert next(reader) == ["step", "value"]
        return [(int(step), float(value)) for step, value in reader]


def train_with_csv_monitor(directory: str) -> dict:
    torch.manual_seed(0)
    config = zerodp_config(
        2,
        gas=2,
        optimizer=optimizer_config("AdamW", lr=1e-2),
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        csv_monitor={"enabled": True, "output_path": directory, "job_name": "job"},
    )
    engine, _, _, _ = zerodp.initialize(model=TinyNet(), config=config)
    expected: dict[str, list[tuple[int, float]]] = {"loss": [], "lr": [], "norm": []}
    losses = []
    for micro in range(6):
        loss = engine(tiny_inputs(dist.get_rank(), micro)).square().mean()
        losses.append(loss.item())
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            step = engine.global_samples
            expected["loss"].append((step, sum(losses) / len(losses)))
            expected["lr"].append((step, engine.get_lr()[0]))
            expected["norm"].append((step, engine.get_global_grad_norm()))
            losses = []
    engine.destroy()
    return expected


def test_csv_monitor_files_hold_the_boundary_values(pools, tmp_path) -> None:
    per_rank = pools(2).run(train_with_csv_monitor, str(tmp_path))
    job = tmp_path / "job"
    files = {p.name for p in job.iterdir()}
    assert {
        "Train_Samples_train_loss.csv",
        "Train_Samples_lr.csv",
        "Train_Samples_grad_norm.csv",
        "Train_Samples_loss_scale.csv",
        "Train_Samples_samples_per_sec.csv",
    } <= files
    expected = per_rank[0]  # rank 0 writes
    loss_rows = _rows(job / "Train_Samples_train_loss.csv")
    assert [s for s, _ in loss_rows] == [16, 32, 48]  # global samples: 2 ranks x 4 x 2 per step
    for index, (step, value) in enumerate(loss_rows):
        # The window's mean loss, averaged over ranks.
        mean = sum(rank["loss"][index][1] for rank in per_rank) / len(per_rank)
        assert step == expected["loss"][index][0] and value == pytest.approx(mean, rel=1e-6)
    lr_rows = _rows(job / "Train_Samples_lr.csv")
    assert [v for _, v in lr_rows] == pytest.approx([v for _, v in expected["lr"]])
    norm_rows = _rows(job / "Train_Samples_grad_norm.csv")
    assert [v for _, v in norm_rows] == pytest.approx([v for _, v in expected["norm"]])
    assert all(v == 1.0 for _, v in _rows(job / "Train_Samples_loss_scale.csv"))
    assert all(v > 0 for _, v in _rows(job / "Train_Samples_samples_per_sec.csv"))


class QuadraticBlocks(nn.Module):
    """loss = sum_b 0.5 * t_b^T A_b t_b + c_b . t_b: each block's Hessian is its A_b."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(n, 1, bias=False) for n in sizes)

    def forward(self, matrices: list[torch.Tensor], shifts: list[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros(())
        for block, a, c in zip(self.blocks, matrices, shifts, strict=True):
            theta = block.weight.view(-1)
            total = total + 0.5 * theta @ (a @ theta) + c @ theta
        return total


def _rank_matrices(rank: int, sizes: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(40 + rank)
    matrices, shifts = [], []
    for n in sizes:
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=generator))
        spectrum = torch.linspace(0.5, 6.0 + rank, n)  # well separated top eigenvalue
        matrices.append(q @ torch.diag(spectrum) @ q.T)
        shifts.append(torch.randn(n, generator=generator))
    return matrices, shifts


def eigenvalues_of_quadratic(stage: int, directory: str) -> tuple[list[float], list[float]]:
    sizes = [6, 9]
    torch.manual_seed(0)
    config = zerodp_config(
        stage,
        micro_batch=1,
        optimizer=optimizer_config("SGD", lr=1e-3),
        persistence_threshold=0,
        csv_monitor={"enabled": True, "output_path": directory, "job_name": "eig"},
        eigenvalue={
            "enabled": True,
            "max_iter": 200,
            "tol": 1e-7,
            "layer_name": "blocks",
            "layer_num": 2,
        },
    )
    engine, _, _, _ = zerodp.initialize(model=QuadraticBlocks(sizes), config=config)
    matrices, shifts = _rank_matrices(dist.get_rank(), sizes)
    engine.backward(engine(matrices, shifts))
    engine.step()
    estimated = [engine.block_eigenvalue[i] for i in range(len(sizes))]
    engine.destroy()
    # The exact answer: the top eigenvalue of the ranks' mean Hessian, per block.
    world = dist.get_world_size()
    all_matrices = [_rank_matrices(r, sizes)[0] for r in range(world)]
    exact = [
        float(torch.linalg.eigvalsh(sum(m[b] for m in all_matrices) / world).max())
        for b in range(len(sizes))
    ]
    return estimated, exact


@pytest.mark.parametrize("stage", [0, 3])
def test_eigenvalue_matches_the_exact_hessian(pools, tmp_path, stage: int) -> None:
    estimated, exact = pools(2).run(eigenvalues_of_quadratic, stage, str(tmp_path))[0]
    assert estimated == pytest.approx(exact, rel=1e-3), (estimated, exact)
    for block, value in enumerate(exact):
        rows = _rows(tmp_path / "eig" / f"Train_Eigenvalues_{block}.csv")
        assert rows[0][1] == pytest.approx(value, rel=1e-3)
