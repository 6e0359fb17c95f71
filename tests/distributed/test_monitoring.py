"""What the engine writes to its monitors, and the Hessian eigenvalue it estimates.

The CSV rows (one per accumulation boundary, at its global sample count) are checked against
the values the training loop saw on every rank (the window's loss averaged over ranks, the
learning rate, the gradient norm) and against values computed independently: the learning
rate from WarmupLR's closed form, the gradient norm from the data-parallel reference's
gradients (`ReferenceDP`); the eigenvalue against the exact top eigenvalue of a quadratic's
mean Hessian.
"""

from __future__ import annotations

import copy
import csv
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyNet, tiny_inputs
from zerodp.testing import ReferenceDP
from zerodp.testing.parity import assert_params_match


def _rows(path: Path) -> list[tuple[int, float]]:
    with path.open() as file:
        reader = csv.reader(file)
        assert next(reader) == ["step", "value"]
        return [(int(step), float(value)) for step, value in reader]


# WarmupLR with DeepSpeed's defaults (warmup_min_lr 0, the peak is the optimizer's lr, "log")
# over 4 steps.
WARMUP_STEPS, WARMUP_MAX_LR = 4, 1e-2


def warmup_lr(k: int) -> float:
    """The closed form: the lr after `k` scheduler steps, DeepSpeed's lr(t = k - 1)."""
    t = k - 1
    if t >= WARMUP_STEPS:
        return WARMUP_MAX_LR
    return WARMUP_MAX_LR * math.log(t + 1) / math.log(WARMUP_STEPS) if t > 0 else 0.0


def train_with_csv_monitor(directory: str) -> dict:
    torch.manual_seed(0)
    gas = 2
    config = zerodp_config(
        2,
        gas=gas,
        optimizer=optimizer_config("AdamW", lr=1e-2),
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": WARMUP_STEPS}},
        csv_monitor={"enabled": True, "output_path": directory, "job_name": "job"},
    )
    model = TinyNet()
    # The reference: a plain copy, gradients averaged by an explicit all_reduce, and AdamW
    # (zerodp's "AdamW" defaults: no weight decay) at the closed-form lr of each step.
    reference = ReferenceDP(
        copy.deepcopy(model), lambda p: torch.optim.AdamW(p, lr=warmup_lr(0), weight_decay=0.0)
    )
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    expected: dict[str, list[tuple[int, float]]] = {
        "loss": [],
        "lr": [],
        "norm": [],
        "lr_closed_form": [],
        "norm_reference": [],
    }
    losses = []
    rank = dist.get_rank()
    for micro in range(6):
        x = tiny_inputs(rank, micro)
        loss = engine(x).square().mean()
        losses.append(loss.item())
        engine.backward(loss)
        reference.run_backward(lambda x=x: (reference.model(x).square().mean() / gas).backward())
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            step = engine.global_samples
            expected["loss"].append((step, sum(losses) / len(losses)))
            expected["lr"].append((step, engine.get_lr()[0]))
            expected["norm"].append((step, engine.get_global_grad_norm()))
            # Independent values: the reference's global gradient norm (before the step; no
            # clipping configured), and the lr after this boundary's scheduler step.
            ref_grads = torch.cat([reference.grad(p).reshape(-1) for p in reference.params])
            expected["norm_reference"].append((step, torch.linalg.vector_norm(ref_grads).item()))
            steps_taken = len(expected["lr"])
            for group in reference.optimizer.param_groups:
                group["lr"] = warmup_lr(steps_taken - 1)  # the lr this step was taken with
            reference.step()
            reference.zero_grad()
            assert_params_match(model, reference, f"after step {steps_taken}")
            expected["lr_closed_form"].append((step, warmup_lr(steps_taken)))
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
    boundaries = [16, 32, 48]  # global samples: 2 ranks x 4 x 2 per step, one row per step
    loss_rows = _rows(job / "Train_Samples_train_loss.csv")
    assert [s for s, _ in loss_rows] == boundaries
    for index, (step, value) in enumerate(loss_rows):
        # The window's mean loss, averaged over ranks.
        mean = sum(rank["loss"][index][1] for rank in per_rank) / len(per_rank)
        assert step == expected["loss"][index][0] and value == pytest.approx(mean, rel=1e-6)
    lr_rows = _rows(job / "Train_Samples_lr.csv")
    assert [v for _, v in lr_rows] == pytest.approx([v for _, v in expected["lr"]])
    assert [s for s, _ in lr_rows] == boundaries
    # WarmupLR's closed form, computed here: 0.01 * log(k) / log(4) after k steps.
    for rank in per_rank:
        assert [s for s, _ in rank["lr_closed_form"]] == boundaries
        assert [v for _, v in lr_rows] == pytest.approx(
            [v for _, v in rank["lr_closed_form"]], rel=1e-6, abs=0
        )
    norm_rows = _rows(job / "Train_Samples_grad_norm.csv")
    assert [v for _, v in norm_rows] == pytest.approx([v for _, v in expected["norm"]])
    assert [s for s, _ in norm_rows] == boundaries
    # The reference's global norm of the averaged gradient (the same on every rank).
    for rank in per_rank:
        assert [s for s, _ in rank["norm_reference"]] == boundaries
        assert [v for _, v in norm_rows] == pytest.approx(
            [v for _, v in rank["norm_reference"]], rel=1e-5, abs=0
        )
    loss_scale_rows = _rows(job / "Train_Samples_loss_scale.csv")
    assert all(v == 1.0 for _, v in loss_scale_rows)
    assert loss_scale_rows == [(step, 1.0) for step in boundaries]  # fp32: no loss scaling
    speed_rows = _rows(job / "Train_Samples_samples_per_sec.csv")
    assert all(v > 0 for _, v in speed_rows)
    assert [s for s, _ in speed_rows] == boundaries


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
