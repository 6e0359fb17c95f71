"""zerodp.optim.schedulers against DeepSpeed's own values and closed forms written out here.

DeepSpeed 0.19.8's values were recorded by tools/make_deepspeed_fixtures.py
(tests/data/deepspeed_checkpoints/schedules.json): the lr of each param group
at optimizer steps 1..25, as DeepSpeed's engine sets them (optimizer step,
then scheduler step). The closed forms use DeepSpeed's step count t: the
optimizer step k (from 1) uses lr(t = k - 2), and t = -1 is the start.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import LRScheduler

from zerodp.config import SchedulerConfig
from zerodp.errors import ConfigError
from zerodp.optim.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler


def make_optimizer(lr: float = 0.1, groups: int = 1) -> torch.optim.Optimizer:
    params = [
        {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr * (i + 1)} for i in range(groups)
    ]
    return torch.optim.AdamW(params, lr=lr)


SCHEDULES = Path(__file__).resolve().parents[1] / "data/deepspeed_checkpoints/schedules.json"


def lrs_over(scheduler: LRScheduler, steps: int) -> list[list[float]]:
    """The lrs optimizer steps 1..steps use (t = -1 .. steps - 2), stepping as torch expects."""
    out = []
    for _ in range(steps):
        out.append([float(lr) for lr in scheduler.get_last_lr()])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def warmup(t: int, n: int, kind: str) -> float:
    n = max(2, n)  # DeepSpeed counts a shorter warmup as 2 steps
    if t < 0:
        return 0.0
    if t >= n:
        return 1.0
    if kind == "linear":
        return t / n
    return math.log(t + 1) / math.log(n)


def expected_warmup_lr(t: int, lo: float, hi: float, n: int, kind: str) -> float:
    return lo + (hi - lo) * warmup(t, n, kind)


def expected_decay_lr(t: int, *, lo: float, hi: float, n: int, total: int, kind: str) -> float:
    n = max(2, n)
    gamma = warmup(t, n, kind) if t < n else max(0.0, (total - t) / max(1, total - n))
    return lo + (hi - lo) * gamma


def expected_cosine_ratio(
    t: int, *, n: int, total: int, min_ratio: float, cos_min: float, kind: str
) -> float:
    n = max(2, n)
    if t < 0:
        return 0.0  # DeepSpeed's first step runs at lr 0
    if t < n:
        return min_ratio + (1 - min_ratio) * warmup(t, n, kind)
    progress = min(1.0, (t - n + 1) / max(1, total - n))
    return cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("n", [1, 5, 10])
def test_warmup_lr_matches_closed_form(kind: str, n: int) -> None:
    sched = WarmupLR(
        make_optimizer(groups=2),
        warmup_min_lr=0.01,
        warmup_max_lr=0.5,
        warmup_num_steps=n,
        warmup_type=kind,
    )
    for step, lrs in enumerate(lrs_over(sched, 3 * n + 5)):
        expected = expected_warmup_lr(step - 1, 0.01, 0.5, n, kind)
        assert lrs == pytest.approx([expected, expected], rel=1e-12, abs=1e-15)


def test_warmup_lr_starts_at_min_and_reaches_max() -> None:
    sched = WarmupLR(make_optimizer(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4)
    lrs = [lr[0] for lr in lrs_over(sched, 7)]
    assert lrs[:2] == [0.0, 0.0]  # t = -1 and t = 0
    assert lrs[5:] == [1.0, 1.0]
    assert lrs == sorted(lrs)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_matches_closed_form(kind: str) -> None:
    lo, hi, n, total = 0.001, 0.2, 6, 20
    sched = WarmupDecayLR(
        make_optimizer(),
        total_num_steps=total,
        warmup_min_lr=lo,
        warmup_max_lr=hi,
        warmup_num_steps=n,
        warmup_type=kind,
    )
    for step, lrs in enumerate(lrs_over(sched, total + 5)):
        assert lrs[0] == pytest.approx(
            expected_decay_lr(step - 1, lo=lo, hi=hi, n=n, total=total, kind=kind), rel=1e-12
        )
    assert sched.get_last_lr()[0] == pytest.approx(lo)  # past the end it stays at min


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_matches_closed_form(kind: str) -> None:
    n, total, min_ratio, cos_min = 5, 30, 0.1, 0.01
    opt = make_optimizer(lr=0.2, groups=2)
    peaks = [group["lr"] for group in opt.param_groups]
    sched = WarmupCosineLR(
        opt,
        total_num_steps=total,
        warmup_num_steps=n,
        warmup_min_ratio=min_ratio,
        cos_min_ratio=cos_min,
        warmup_type=kind,
    )
    for step, lrs in enumerate(lrs_over(sched, total + 5)):
        ratio = expected_cosine_ratio(
            step - 1, n=n, total=total, min_ratio=min_ratio, cos_min=cos_min, kind=kind
        )
        assert lrs == pytest.approx([p * ratio for p in peaks], rel=1e-12)


def test_cosine_starts_at_zero_and_ends_at_min_ratio() -> None:
    sched = WarmupCosineLR(
        make_optimizer(lr=0.3), total_num_steps=10, warmup_num_steps=2, warmup_type="linear"
    )
    lrs = [lr[0] for lr in lrs_over(sched, 13)]
    assert lrs[:3] == [0.0, 0.0, pytest.approx(0.15)]  # t = -1, 0, 1
    assert max(lrs) < 0.3  # DeepSpeed's cosine starts one step into its decay
    assert lrs[10] == pytest.approx(0.3 * 1e-4)  # t = 9: progress 1
    assert lrs[12] == pytest.approx(0.3 * 1e-4)


Factory = Callable[[torch.optim.Optimizer], LRScheduler]

FACTORIES: dict[str, Factory] = {
    "WarmupLR": lambda o: WarmupLR(o, warmup_num_steps=7, warmup_max_lr=0.3),
    "WarmupDecayLR": lambda o: WarmupDecayLR(o, total_num_steps=25, warmup_num_steps=7),
    "WarmupCosineLR": lambda o: WarmupCosineLR(o, total_num_steps=25, warmup_num_steps=7),
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_state_dict_round_trip_resumes_at_same_lr(name: str) -> None:
    factory = FACTORIES[name]
    opt = make_optimizer()
    reference = factory(opt)
    full = lrs_over(reference, 20)

    opt_a = make_optimizer()
    first = factory(opt_a)
    lrs_over(first, 9)
    saved_sched, saved_opt = first.state_dict(), opt_a.state_dict()

    # The usual resume order: build both, then load both state dicts.
    opt_b = make_optimizer(lr=123.0)  # a fresh run whose own lr must not leak in
    resumed = factory(opt_b)
    opt_b.load_state_dict(saved_opt)
    resumed.load_state_dict(saved_sched)
    assert [g["lr"] for g in opt_b.param_groups] == pytest.approx(full[9])
    resumed_lrs = lrs_over(resumed, 11)
    assert [lr for step in resumed_lrs for lr in step] == pytest.approx(
        [lr for step in full[9:20] for lr in step]
    )


@pytest.mark.parametrize("name", ["WarmupLR", "WarmupDecayLR"])
def test_last_batch_iteration_resumes_without_initial_lr(name: str) -> None:
    params: dict[str, Any] = {"warmup_num_steps": 7, "last_batch_iteration": 4}
    if name == "WarmupDecayLR":
        params["total_num_steps"] = 25
    cls = WarmupLR if name == "WarmupLR" else WarmupDecayLR
    sched = cls(make_optimizer(), **params)
    assert sched.last_batch_iteration == 4
    peak = 0.1 if name == "WarmupLR" else 0.001  # WarmupLR's default peak: the group's lr
    assert sched.get_last_lr()[0] == pytest.approx(expected_warmup_lr(4, 0.0, peak, 7, "log"))


def test_cosine_resume_without_initial_lr_names_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"no 'initial_lr'.*load_state_dict"):
        WarmupCosineLR(
            make_optimizer(), total_num_steps=20, warmup_num_steps=5, last_batch_iteration=3
        )


def test_works_with_plain_adamw_on_tiny_parameter() -> None:
    weight = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.AdamW([weight], lr=0.05, weight_decay=0.0)
    sched = WarmupLR(
        opt, warmup_min_lr=0.0, warmup_max_lr=0.05, warmup_num_steps=3, warmup_type="linear"
    )
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        (weight**2).sum().backward()
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.0, 0.0, 0.05 / 3, 0.1 / 3, 0.05])
    assert weight.item() < 1.0  # the optimizer really used the scheduled lrs


@pytest.mark.parametrize(
    ("raw", "cls"),
    [
        ({"type": "warmuplr", "params": {"warmup_num_steps": 3}}, WarmupLR),
        (
            {"type": "WarmupDecayLR", "params": {"total_num_steps": 9, "warmup_num_steps": 3}},
            WarmupDecayLR,
        ),
        (
            {"type": "warmupcosinelr", "params": {"total_num_steps": 9, "warmup_num_steps": 3}},
            WarmupCosineLR,
        ),
    ],
)
def test_build_scheduler_from_config(raw: dict[str, Any], cls: type[LRScheduler]) -> None:
    sched = build_scheduler(make_optimizer(), SchedulerConfig.from_dict(raw))
    assert type(sched) is cls
    assert isinstance(sched, LRScheduler)
    assert sched.last_epoch == 0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda o: WarmupLR(o, warmup_num_steps=0), "config key 'warmup_num_steps': got 0"),
        (
            lambda o: WarmupLR(o, warmup_type="cosine"),
            "'warmup_type': got 'cosine'; allowed: 'log' or",
        ),
        (
            lambda o: WarmupCosineLR(o, total_num_steps=10, warmup_min_ratio=1.5),
            "config key 'warmup_min_ratio': got 1.5",
        ),
    ],
)
def test_bad_arguments_raise_config_error(make: Factory, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        make(make_optimizer())


def _deepspeed_cases() -> list[dict[str, Any]]:
    return json.loads(SCHEDULES.read_text())["cases"]


@pytest.mark.parametrize("case", _deepspeed_cases(), ids=lambda c: f"{c['type']}{c['params']}")
def test_schedules_match_deepspeed_step_for_step(case: dict[str, Any]) -> None:
    recorded = json.loads(SCHEDULES.read_text())
    weights = [torch.nn.Parameter(torch.zeros(2)) for _ in recorded["group_lrs"]]
    optimizer = torch.optim.SGD(
        [{"params": [w], "lr": lr} for w, lr in zip(weights, recorded["group_lrs"], strict=True)]
    )
    config = SchedulerConfig.from_dict({"type": case["type"], "params": case["params"]})
    sched = build_scheduler(optimizer, config)
    assert lrs_over(sched, len(case["lrs"])) == case["lrs"]  # to the bit
    assert sched.last_batch_iteration == case["state_dict"]["last_batch_iteration"]


@pytest.mark.parametrize("case", _deepspeed_cases()[::3], ids=lambda c: c["type"])
def test_deepspeed_state_dict_resumes_where_deepspeed_stood(case: dict[str, Any]) -> None:
    """DeepSpeed's {"last_batch_iteration": t} puts the lr of t in place, then steps on."""
    recorded = json.loads(SCHEDULES.read_text())
    lrs = recorded["group_lrs"]
    weights = [torch.nn.Parameter(torch.zeros(2)) for _ in lrs]
    optimizer = torch.optim.SGD(
        [{"params": [w], "lr": lr} for w, lr in zip(weights, lrs, strict=True)]
    )
    config = SchedulerConfig.from_dict({"type": case["type"], "params": case["params"]})
    sched = build_scheduler(optimizer, config)
    saved_at = 9  # a DeepSpeed run saved after 9 optimizer steps holds t = 8
    sched.load_state_dict({"last_batch_iteration": saved_at - 1})
    assert lrs_over(sched, 6) == case["lrs"][saved_at : saved_at + 6]
