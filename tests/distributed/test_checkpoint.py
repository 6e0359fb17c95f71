"""Checkpoints: validated on every rank, atomic, exact on resume, reshardable, consolidatable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import DropoutNet, LifecycleNet, TinyNet, tiny_inputs
from zerodp.testing import DistributedTestError, ReferenceDP, run_distributed
from zerodp.testing.parity import assert_params_match

ROOT = Path(__file__).resolve().parents[2]


# What every checkpoint test trains with: a scheduler and a seed, so that resuming must restore
# them too; a small bucket, so that the model is split over several flat groups.
RECIPE = {
    "optimizer": optimizer_config("AdamW", lr=1e-2, weight_decay=0.01),
    "clipping": 1.0,
    "persistence_threshold": 12,
    "zero": {"reduce_bucket_size": 64},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 8}},
    "seed": 7,
}


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(99)
    return TensorDataset(torch.randn(200, 7, generator=generator))


def _build(stage: int, dtype: str = "fp32", seed: int = 0):
    torch.manual_seed(seed)
    model = DropoutNet()
    engine, _, loader, _ = zerodp.initialize(
        model=model, config=zerodp_config(stage, dtype=dtype, **RECIPE), training_data=_dataset()
    )
    return model, engine, loader


def _train(engine, loader, steps: int) -> None:
    done = 0
    while done < steps:
        for (x,) in loader:
            engine.backward(engine(x).float().square().mean())
            engine.step()
            done += 1
            if done == steps:
                return


def _snapshot(model: nn.Module, engine) -> dict:
    return {
        "params": [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()],
        "exp_avg": [
            zerodp.utils.safe_get_full_optimizer_state(p, "exp_avg") for p in model.parameters()
        ],
        "lr": engine.get_lr(),
        "counters": (engine.global_steps, engine.micro_steps, engine.global_samples),
        "rng": torch.get_rng_state(),
    }


# -- resume is exact -------------------------------------------------------------------------


def train_straight(stage: int, dtype: str, steps: int) -> dict:
    model, engine, loader = _build(stage, dtype)
    _train(engine, loader, steps)
    snapshot = _snapshot(model, engine)
    engine.destroy()
    return snapshot


def train_and_save(stage: int, dtype: str, steps: int, directory: str) -> str:
    _model, engine, loader = _build(stage, dtype)
    _train(engine, loader, steps)
    path = engine.save_checkpoint(directory, client_state={"note": "half way", "steps": steps})
    engine.destroy()
    return path


def load_and_train(stage: int, dtype: str, steps: int, directory: str) -> tuple[dict, dict]:
    model, engine, loader = _build(stage, dtype, seed=123)  # different init: must be overwritten
    _, client_state = engine.load_checkpoint(directory)
    _train(engine, loader, steps)
    snapshot = _snapshot(model, engine)
    engine.destroy()
    return snapshot, client_state


def _assert_same(a: dict, b: dict) -> None:
    for x, y in zip(a["params"], b["params"], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    for x, y in zip(a["exp_avg"], b["exp_avg"], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert a["lr"] == b["lr"]
    assert a["counters"] == b["counters"]
    assert torch.equal(a["rng"], b["rng"])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_exact(pools, tmp_path, stage: int, dtype: str) -> None:
    """10 steps straight == 5 steps, save, fresh processes, load, 5 steps (bitwise)."""
    straight = pools(2).run(train_straight, stage, dtype, 10)
    run_distributed(train_and_save, 2, stage, dtype, 5, str(tmp_path))
    resumed = run_distributed(load_and_train, 2, stage, dtype, 5, str(tmp_path))
    for rank in range(2):
        snapshot, client_state = resumed[rank]
        _assert_same(straight[rank], snapshot)
        assert client_state == {"note": "half way", "steps": 5}


# -- validation before any collective -------------------------------------------------------


def bad_save(save_dir: object, tag: object) -> str:
    torch.manual_seed(0)
    engine, _, _, _ = zerodp.initialize(model=TinyNet(), config=zerodp_config(2, **RECIPE))
    try:
        with pytest.raises((ValueError, OSError)) as error:
            engine.save_checkpoint(save_dir, tag=tag)
        return f"{type(error.value).__name__}: {error.value}"
    finally:
        engine.destroy()


def test_invalid_save_targets_raise_on_every_rank(pools, tmp_path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    cases = {
        "none": (None, None, "save_dir"),
        "empty": ("", None, "save_dir"),
        "a_file": (str(a_file), None, "is a file"),
        "under_a_file": (str(a_file / "sub"), None, "is a file"),
        "unwritable": ("/sys/zerodp-checkpoints", None, "not writable"),
        "tag_with_separator": (str(tmp_path / "ok"), "a/b", "path separators"),
        "tag_not_str": (str(tmp_path / "ok"), 3, "tag"),
    }
    for name, (save_dir, tag, expected) in cases.items():
        messages = pools(2).run(bad_save, save_dir, tag, timeout_s=60)
        assert all(expected in m for m in messages), (name, messages)
    assert not (tmp_path / "ok").exists()


# -- atomic saves ------------------------------------------------------------------------------


def save_then_die_in_second_save(directory: str, weights_file: str) -> None:
    model, engine, loader = _build(2)
    _train(engine, loader, 2)
    engine.save_checkpoint(directory, tag="first")
    # What "first" holds, and what "second" would have held: written down here, since this
    # run dies (the test reads them from `weights_file`).
    first = [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
    _train(engine, loader, 1)
    second = [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
    if dist.get_rank() == 0:
        torch.save({"first": first, "second": second}, weights_file)
    dist.barrier()
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def die_on_rank_1(self, plan, planner):  # type: ignore[no-untyped-def]
        if dist.get_rank() == 1:
            os._exit(17)  # killed part-way through writing
        return original(self, plan, planner)

    FileSystemWriter.write_data = die_on_rank_1  # type: ignore[method-assign]
    engine.save_checkpoint(directory, tag="second")


def load_first(directory: str) -> list[torch.Tensor]:
    model, engine, _ = _build(2, seed=5)
    path, _ = engine.load_checkpoint(directory)
    assert path.endswith("first"), path
    params = [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
    engine.destroy()
    return params


def test_a_save_killed_part_way_keeps_the_previous_checkpoint(tmp_path) -> None:
    directory, weights_file = tmp_path / "ckpt", tmp_path / "weights.pt"
    with pytest.raises(DistributedTestError):
        run_distributed(
            save_then_die_in_second_save, 2, str(directory), str(weights_file), timeout_s=90
        )
    assert (directory / "latest").read_text() == "first"
    assert (directory / "first" / "zerodp_state.json").is_file()
    assert not (directory / "second").exists()
    recorded = torch.load(weights_file, weights_only=True)
    # The step between the saves changed the weights, so "first" is told apart from "second".
    assert any(not torch.equal(a, b) for a, b in zip(*recorded.values(), strict=True))
    for rank, params in enumerate(run_distributed(load_first, 2, str(directory))):
        assert all(torch.isfinite(p).all() for p in params)
        assert len(params) == len(recorded["first"]), rank
        for index, (loaded, saved) in enumerate(zip(params, recorded["first"], strict=True)):
            torch.testing.assert_close(loaded, saved, rtol=0, atol=0, msg=f"rank {rank}, {index}")


# -- resharding across world sizes and stages ----------------------------------------------


def save_for_resharding(stage: int, directory: str) -> dict:
    model, engine, loader = _build(stage)
    _train(engine, loader, 3)
    engine.save_checkpoint(directory)
    snapshot = _snapshot(model, engine)
    snapshot["exp_avg_sq"] = [
        zerodp.utils.safe_get_full_optimizer_state(p, "exp_avg_sq") for p in model.parameters()
    ]
    snapshot["step"] = float(
        zerodp.utils.safe_get_full_optimizer_state(next(model.parameters()), "step")
    )
    engine.destroy()
    return snapshot


def load_resharded(stage: int, directory: str, saved: dict) -> None:
    """Load at another stage and world size; then one step equals an unsharded reference."""
    model, engine, _ = _build(stage, seed=321)
    engine.load_checkpoint(directory)
    loaded = _snapshot(model, engine)
    for x, y in zip(loaded["params"], saved["params"], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    for x, y in zip(loaded["exp_avg"], saved["exp_avg"], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert loaded["lr"] == saved["lr"]
    assert loaded["counters"][0] == saved["counters"][0]

    reference_model = DropoutNet()
    with torch.no_grad():
        for p, value in zip(reference_model.parameters(), saved["params"], strict=True):
            p.copy_(value)
    reference = ReferenceDP(
        reference_model,
        lambda params: torch.optim.AdamW(params, lr=saved["lr"][0], weight_decay=0.01),
    )
    for p, m, v in zip(reference.params, saved["exp_avg"], saved["exp_avg_sq"], strict=True):
        reference.optimizer.state[p] = {
            "step": torch.tensor(saved["step"]),
            "exp_avg": m.clone(),
            "exp_avg_sq": v.clone(),
        }
    model.eval()
    reference_model.eval()  # no dropout: the two sides draw random numbers differently
    x = tiny_inputs(dist.get_rank(), 50)
    engine.backward(engine(x).square().mean())
    reference.run_backward(lambda: reference_model(x).square().mean().backward())
    engine.optimizer.step()  # the optimizer alone: the scheduler would change the lr
    reference.clip(1.0)
    reference.step()
    assert_params_match(model, reference, f"after loading at stage {stage}")
    engine.destroy()


@pytest.mark.parametrize(
    ("save_stage", "load_stage", "load_world_size"),
    [(2, 2, 1), (2, 3, 3), (3, 0, 1), (3, 1, 3), (1, 3, 2), (0, 2, 3)],
)
def test_resharding(pools, tmp_path, save_stage, load_stage, load_world_size) -> None:
    saved = pools(2).run(save_for_resharding, save_stage, str(tmp_path))[0]
    pools(load_world_size).run(load_resharded, load_stage, str(tmp_path), saved)


# -- consolidation ---------------------------------------------------------------------------


def save_for_consolidation(stage: int, dtype: str, directory: str) -> dict:
    model, engine, loader = _build(stage, dtype)
    _train(engine, loader, 2)
    engine.save_checkpoint(directory, tag="final")
    values = {
        name: zerodp.utils.safe_get_full_fp32_param(p) for name, p in model.named_parameters()
    }
    engine.destroy()
    return values


@pytest.mark.parametrize(("stage", "dtype"), [(3, "fp32"), (3, "bf16"), (1, "fp32")])
def test_consolidate_writes_a_plain_state_dict(pools, tmp_path, stage, dtype) -> None:
    values = pools(2).run(save_for_consolidation, stage, dtype, str(tmp_path / "ckpt"))[0]
    out = tmp_path / "model.safetensors"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerodp.launch.cli",
            "consolidate",
            str(tmp_path / "ckpt"),
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    from safetensors.torch import load_file

    plain = DropoutNet()
    plain.load_state_dict(load_file(str(out)), strict=True)  # no process group anywhere
    for name, param in plain.named_parameters():
        torch.testing.assert_close(param.detach(), values[name], rtol=0, atol=0)

    from zerodp.checkpoint_io.consolidate import consolidate_checkpoint

    torch_file = consolidate_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "model.pt"))
    state = torch.load(torch_file, weights_only=True)
    DropoutNet().load_state_dict(state, strict=True)
    # Its values are the trained model's full fp32 parameters.
    assert set(state) == set(values)
    for name, value in values.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


# -- safe loading --------------------------------------------------------------------------


def load_into_other_model(directory: str) -> str:
    torch.manual_seed(0)
    config = zerodp_config(2, **RECIPE)
    engine, _, _, _ = zerodp.initialize(model=LifecycleNet(), config=config)
    with pytest.raises(zerodp.CheckpointError) as error:
        engine.load_checkpoint(directory)
    engine.destroy()
    return str(error.value)


def load_broken(directory: str) -> str:
    _model, engine, _ = _build(2)
    with pytest.raises(zerodp.CheckpointError) as error:
        engine.load_checkpoint(directory)
    engine.destroy()
    return str(error.value)


def test_wrong_model_and_broken_files_are_clear_errors(pools, tmp_path) -> None:
    pools(2).run(train_and_save, 2, "fp32", 2, str(tmp_path))
    messages = pools(2).run(load_into_other_model, str(tmp_path), timeout_s=60)
    for message in messages:
        assert "different model" in message
        missing = message.split("missing in the checkpoint: ")[1].split(" | ")[0]
        unexpected = message.split("unexpected (not in the model): ")[1].split(" | ")[0]
        assert "inp.bias" in missing and "frozen.weight" in missing, message
        assert "body.fc1.bias" in unexpected, message

    checkpoint = tmp_path / (tmp_path / "latest").read_text()
    data_file = sorted(checkpoint.glob("*.distcp"))[0]
    original = data_file.read_bytes()
    data_file.write_bytes(original[: len(original) // 2])  # truncated
    messages = pools(2).run(load_broken, str(tmp_path), timeout_s=60)
    assert all("truncated" in m for m in messages), messages
    data_file.write_bytes(original)

    state_file = checkpoint / "zerodp_state.json"
    state_file.write_text(state_file.read_text()[:100])  # corrupted JSON
    messages = pools(2).run(load_broken, str(tmp_path), timeout_s=60)
    assert all("corrupted" in m for m in messages), messages

    (tmp_path / "latest").write_text("no_such_tag")
    messages = pools(2).run(load_broken, str(tmp_path), timeout_s=60)
    assert all("does not exist" in m for m in messages), messages


def test_checkpoint_json_holds_plain_data_only(pools, tmp_path) -> None:
    pools(2).run(train_and_save, 3, "bf16", 2, str(tmp_path))
    checkpoint = tmp_path / (tmp_path / "latest").read_text()
    shared = json.loads((checkpoint / "zerodp_state.json").read_text())
    assert shared["zero_stage"] == 3 and shared["world_size"] == 2
    assert shared["client_state"] == {"note": "half way", "steps": 2}


def load_from_empty(directory: str) -> tuple[object, object]:
    _, engine, _ = _build(2)
    result = engine.load_checkpoint(directory)
    engine.destroy()
    return result


def test_loading_when_nothing_was_saved_returns_none(pools, tmp_path) -> None:
    """As in DeepSpeed: a run that resumes before its first save starts afresh."""
    for directory in (tmp_path, tmp_path / "not_created_yet"):
        assert pools(2).run(load_from_empty, str(directory)) == [(None, None), (None, None)]


def _plain_engine(stage: int) -> zerodp.ZeroEngine:
    """`_build`'s model and optimizer without an LR scheduler or a data loader."""
    torch.manual_seed(0)
    config = zerodp_config(stage, optimizer=optimizer_config("AdamW", lr=1e-2))
    return zerodp.initialize(model=DropoutNet(), config=config)[0]


def reports_of_missing_pieces(directory: str) -> list[list[str]]:
    """What a load leaves as it was when the checkpoint and the engine differ in pieces."""
    plain = _plain_engine(1)
    plain.backward(plain(tiny_inputs(dist.get_rank(), 0)).square().mean())
    plain.step()
    plain.save_checkpoint(directory, tag="plain")
    plain.destroy()
    _, engine, _ = _build(1)
    before = engine.lr_scheduler.state_dict()
    engine.load_checkpoint(directory, tag="plain", load_optimizer_states=False)
    unchanged = engine.lr_scheduler.state_dict() == before
    first = [*engine.last_load_report.not_restored, f"scheduler unchanged: {unchanged}"]
    engine.save_checkpoint(directory, tag="full")
    engine.destroy()
    plain = _plain_engine(1)
    plain.load_checkpoint(directory, tag="full", load_optimizer_states=False)
    second = list(plain.last_load_report.not_restored)
    plain.destroy()
    return [first, second]


def test_the_load_report_names_pieces_the_checkpoint_or_the_engine_lacks(pools, tmp_path) -> None:
    """A checkpoint without LR scheduler or data-loader state leaves the engine's as they
    were, and a scheduler state with no scheduler to take it is dropped: each is said in
    the report (a warning), not reported restored "as saved"."""
    first, second = pools(2).run(reports_of_missing_pieces, str(tmp_path))[0]
    assert "LR scheduler (the checkpoint has no LR scheduler state)" in first, first
    assert "data-loader position (the checkpoint has no data-loader position)" in first, first
    assert "scheduler unchanged: True" in first
    assert (
        "LR scheduler (the checkpoint's LR scheduler state: this engine has no scheduler)" in second
    ), second
