"""Faults outside checkpoints: ranks that disagree, a frozen peer, misuse of the engine.

Each case is bounded in time: the pool's `timeout_s`, or the launch's `timeout`. References
are computed in the test (the weights before a refused step, the wall-clock marks of the
frozen peer's script).
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyNet, tiny_inputs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("frozen_peer_script.py")


def _config(stage: int, **extra) -> dict:
    return zerodp_config(
        stage, optimizer=optimizer_config("AdamW", lr=1e-2), persistence_threshold=0, **extra
    )


def _params(model) -> list[torch.Tensor]:
    return [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()]


# -- 7. ranks agree at start-up -------------------------------------------------------------


def start_disagreeing(stage: int) -> list[tuple[str, float]]:
    rank = dist.get_rank()
    out = []
    cases = {
        "stage": lambda: (TinyNet(), _config(stage if rank == 0 else 2)),
        "micro batch": lambda: (TinyNet(), _config(stage, micro_batch=4 if rank == 0 else 8)),
        "model": lambda: (_frozen_fc1(rank == 1), _config(stage)),
    }
    for build in cases.values():
        torch.manual_seed(0)
        model, config = build()
        start = time.monotonic()
        with pytest.raises(zerodp.RankMismatchError) as error:
            zerodp.initialize(model=model, config=config)
        out.append((str(error.value), time.monotonic() - start))
    return out


def _frozen_fc1(frozen: bool) -> TinyNet:
    model = TinyNet()
    model.fc1.weight.requires_grad_(not frozen)
    return model


@pytest.mark.parametrize("stage", [1, 3])
def test_ranks_that_disagree_fail_at_initialize_on_every_rank(pools, stage: int) -> None:
    results = pools(2).run(start_disagreeing, stage, timeout_s=60)
    expected = ["zero_optimization.stage", "train_micro_batch_size_per_gpu", "fc1.weight"]
    for (message0, seconds0), (message1, seconds1), key in zip(*results, expected, strict=True):
        assert message0 == message1, (message0, message1)
        assert key in message0 and "rank 0" in message0 and "rank 1" in message0, message0
        assert max(seconds0, seconds1) < 10
    assert "requires_grad=False" in results[0][2][0]


# -- 8. a frozen peer ends the job at comms_timeout_s, naming the collective ---------------


def _launch(stage: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "zerodp.launch.cli", "run", "-n", "2", str(SCRIPT), str(stage)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_frozen_peer_is_a_named_error_at_the_timeout() -> None:
    """comms_timeout_s 10: rank 0 fails no sooner than the timeout and long before the default
    one (minutes), naming the collective; `zerodp run` ends with torchrun's failure summary and
    rank 0's exit status. The upper bound leaves room for a loaded CI machine."""
    launches = {stage: _launch(stage) for stage in (1, 3)}  # side by side: one wait for both
    for stage, launch in launches.items():
        try:
            out, err = launch.communicate(timeout=150)
        finally:
            launch.kill()
        marks = {line.split()[0]: float(line.split()[1]) for line in out.splitlines()
                 if line.startswith(("FROZEN ", "FAILED "))}  # fmt: skip
        assert set(marks) == {"FROZEN", "FAILED"}, (out, err)
        assert 9.5 < marks["FAILED"] - marks["FROZEN"] < 45, marks
        assert "rank 0: collective " in out and "failed after 1" in out, out
        # Rank 0's next backward (stage 1) or forward (stage 3) waits first in the agreement
        # on it ([Note: agreeing before a collective]), named with the collective it precedes.
        named = "agreement before reduce_scatter" if stage == 1 else "agreement before gather"
        assert f"collective {named} #" in out and "from zerodp/" in out, out
        assert "from zerodp/comm/" not in out, out  # the site is the caller of zerodp.comm
        assert "comms_timeout_s" in out
        assert launch.returncode == 3, (launch.returncode, err)
        assert "Root Cause (first observed failure)" in err and "exitcode  : 3" in err, err


# -- 9. misuse is refused ----------------------------------------------------------------------


def misuse(stage: int) -> dict[str, str]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyNet()
    engine, optimizer, _, _ = zerodp.initialize(model=model, config=_config(stage))
    messages: dict[str, str] = {}
    engine.backward(engine(tiny_inputs(rank, 0)).square().mean())
    engine.step()
    after_one = _params(model)
    with pytest.raises(zerodp.LifecycleError) as error:
        engine.step()
    messages["step twice"] = str(error.value)
    with pytest.raises(zerodp.LifecycleError):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(after_one, _params(model), strict=True))
    engine.backward(engine(tiny_inputs(rank, 1)).square().mean())
    engine.step()  # a backward again: the next step is fine

    engine.destroy()
    x = tiny_inputs(rank, 2)
    calls = {
        "forward": lambda: engine(x),
        "backward": lambda: engine.backward(model(x).square().mean()),
        "step": engine.step,
        "zero_grad": engine.zero_grad,
        "optimizer.step": optimizer.step,
        "save_checkpoint": lambda: engine.save_checkpoint("/nonexistent-never-written"),
        "load_checkpoint": lambda: engine.load_checkpoint("/nonexistent-never-read", tag="t"),
    }
    for name, call in calls.items():
        with pytest.raises(zerodp.LifecycleError, match="destroy") as error:
            call()
        messages[f"after destroy: {name}"] = str(error.value)
    model(x)  # the module itself stays usable
    return messages


def step_without_any_backward(stage: int) -> list[str]:
    torch.manual_seed(0)
    engine, _, _, _ = zerodp.initialize(model=TinyNet(), config=_config(stage))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.step()
        engine.step()  # no backward ever: warned once, never an error (DeepSpeed steps)
    engine.destroy()
    return [str(w.message) for w in caught if "no backward" in str(w.message)]


def data_too_small(stage: int) -> list[str]:
    messages = []
    for size in (0, 5):
        dataset = TensorDataset(torch.randn(size, 7))
        with pytest.raises(zerodp.UsageError) as error:
            zerodp.initialize(model=TinyNet(), config=_config(stage), training_data=dataset)
        messages.append(str(error.value))
    return messages


@pytest.mark.parametrize("stage", [1, 3])
def test_misuse_is_refused(pools, stage: int) -> None:
    messages = pools(2).run(misuse, stage, timeout_s=60)
    assert messages[0] == messages[1]
    assert "twice after one backward" in messages[0]["step twice"]
    assert all("zerodp.initialize" in m for k, m in messages[0].items() if "destroy" in k)
    warned = pools(2).run(step_without_any_backward, stage, timeout_s=60)
    assert [len(w) for w in warned] == [1, 1]
    empty, short = pools(2).run(data_too_small, stage, timeout_s=60)[0]
    assert "0 samples" in empty
    assert "5 samples" in short and "4 x 2 data ranks = 8" in short


def non_finite(stage: int, dtype: str, policy: str, directory: str) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyNet()
    monitor = {"enabled": True, "output_path": directory, "job_name": "nf"}
    config = _config(stage, dtype=dtype, on_non_finite=policy, csv_monitor=monitor)
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    engine.backward(engine(tiny_inputs(rank, 0)).float().square().mean())
    engine.step()
    before = _params(model)
    x = tiny_inputs(rank, 1)
    if rank == 1:
        x[0, 0] = math.inf  # one rank's loss is inf: its gradients are NaN
    result: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            engine.backward(engine(x).float().square().mean())
            engine.step()
            if policy == "warn":  # reported when the next step reads it (no stall per step)
                engine.backward(engine(tiny_inputs(rank, 2)).float().square().mean())
                engine.step()
        except zerodp.NonFiniteError as error:
            result["raised"] = str(error)
    result["warnings"] = [str(w.message) for w in caught if "gradient norm" in str(w.message)]
    after = _params(model)
    result["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    result["finite"] = all(bool(torch.isfinite(p).all()) for p in after)
    if policy == "skip":  # training goes on from the skipped step
        engine.backward(engine(tiny_inputs(rank, 2)).float().square().mean())
        engine.step()
        result["moved_after"] = not all(
            torch.equal(a, b) for a, b in zip(before, _params(model), strict=True)
        )
    engine.destroy()
    return result


@pytest.mark.parametrize(("stage", "dtype"), [(1, "fp32"), (3, "bf16")])
def test_a_non_finite_step_is_warned_skipped_or_raised(pools, tmp_path, stage, dtype) -> None:
    warn = pools(2).run(non_finite, stage, dtype, "warn", str(tmp_path / "warn"))
    for result in warn:  # the default: a warning naming the step; the weights go non-finite
        assert len(result["warnings"]) == 1 and "optimizer step 2" in result["warnings"][0]
        assert not result["finite"]
    csv = next((tmp_path / "warn").rglob("*non_finite_steps.csv")).read_text()
    assert csv.strip().splitlines()[-1].split(",")[-1] in ("1", "1.0"), csv

    skip = pools(2).run(non_finite, stage, dtype, "skip", str(tmp_path / "skip"))
    for result in skip:  # skipped on every rank alike: nothing changed, training goes on
        assert result["unchanged"] and result["finite"] and result["moved_after"]
        assert "skipped on every rank" in result["warnings"][0]

    raised = pools(2).run(non_finite, stage, dtype, "raise", str(tmp_path / "raise"))
    assert raised[0]["raised"] == raised[1]["raised"]
    assert "optimizer step 2" in raised[0]["raised"]
    assert all(r["unchanged"] for r in raised)
