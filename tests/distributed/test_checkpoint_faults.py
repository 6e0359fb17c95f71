"""Checkpoints under faults: planted pickles, flipped bytes, kills inside the commit, a full
disk, saves inside an accumulation window, an optimizer switch, damaged JSON values.

Every case runs at world size 2 on the session's pools (the kill cases kill a forked child
of the test process inside `paths.commit`); each reference is computed in the test: the
engine's own state before a refused load, an uninterrupted run for resume, a marker file a
payload would create.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import DropoutNet
from zerodp.checkpoint_io import paths
from zerodp.checkpoint_io.safe_metadata import read_metadata

ROOT = Path(__file__).resolve().parents[2]


def _config(stage: int, gas: int = 1, optimizer: str = "AdamW", **extra) -> dict:
    params = {"lr": 1e-2, "weight_decay": 0.01} if optimizer != "SGD" else {"lr": 1e-2}
    return zerodp_config(
        stage,
        gas=gas,
        optimizer=optimizer_config(optimizer, **params),
        clipping=1.0,
        persistence_threshold=12,
        zero={"reduce_bucket_size": 64},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 8}},
        seed=7,
        **extra,
    )


def _dataset() -> TensorDataset:
    return TensorDataset(torch.randn(200, 7, generator=torch.Generator().manual_seed(99)))


def _build(stage: int, gas: int = 1, seed: int = 0, optimizer: str = "AdamW", **extra):
    torch.manual_seed(seed)
    model = DropoutNet()
    engine, _, loader, _ = zerodp.initialize(
        model=model, config=_config(stage, gas, optimizer, **extra), training_data=_dataset()
    )
    return model, engine, loader


def _micro_steps(engine, loader, count: int, after_each=None) -> None:
    """`count` micro-steps (backward + step each) from where the loader is."""
    done = 0
    while done < count:
        for (x,) in loader:
            engine.backward(engine(x).float().square().mean())
            engine.step()
            done += 1
            if after_each is not None:
                after_each(done)
            if done == count:
                return


def _state(model: nn.Module, engine) -> dict:
    """Everything a resumed run must reproduce, bit for bit."""
    out = {
        "params": [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()],
        "lr": engine.get_lr(),
        "counters": (engine.global_steps, engine.micro_steps, engine.global_samples),
        "rng": torch.get_rng_state(),
    }
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = [zerodp.utils.safe_get_full_optimizer_state(p, key) for p in model.parameters()]
    return out


def _assert_same(a: dict, b: dict, what: str) -> None:
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for index, (x, y) in enumerate(zip(a[key], b[key], strict=True)):
            if x is None or y is None:
                assert x is None and y is None, (what, key, index)
                continue
            assert torch.equal(x, y), f"{what}: {key}[{index}] differs"
    assert a["lr"] == b["lr"], what
    assert a["counters"] == b["counters"], what
    assert torch.equal(a["rng"], b["rng"]), what


# -- 3. a save between micro-steps resumes bitwise ----------------------------------------


def resume_from_every_micro_step(stage: int, gas: int, directory: str) -> int:
    count = 2 * gas + 1  # two boundaries and a window begun
    model, engine, loader = _build(stage, gas)
    _micro_steps(engine, loader, count)
    straight = _state(model, engine)
    engine.destroy()

    model, engine, loader = _build(stage, gas)
    _micro_steps(engine, loader, count, lambda done: engine.save_checkpoint(directory, f"m{done}"))
    saving = _state(model, engine)
    engine.destroy()
    _assert_same(straight, saving, "a run that saved after every micro-step")

    for done in range(1, count):
        model, engine, loader = _build(stage, gas, seed=123)  # other weights: all must load
        engine.load_checkpoint(directory, tag=f"m{done}")
        assert engine.micro_steps == done
        _micro_steps(engine, loader, count - done)
        _assert_same(straight, _state(model, engine), f"stage {stage}, gas {gas}, from {done}")
        engine.destroy()
    return count - 1


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_save_inside_an_accumulation_window_resumes_bitwise(pools, tmp_path, stage) -> None:
    for gas in (2, 4):
        resumed = pools(2).run(resume_from_every_micro_step, stage, gas, str(tmp_path / f"g{gas}"))
        assert resumed == [2 * gas, 2 * gas]


def save_mid_window(stage: int, directory: str) -> list[torch.Tensor]:
    model, engine, loader = _build(stage, gas=4)
    _micro_steps(engine, loader, 6)  # one boundary, then two of four micro-steps
    engine.save_checkpoint(directory, tag="mid")
    grads = [zerodp.utils.safe_get_full_grad(p) for p in model.parameters()]
    engine.destroy()
    return grads


def load_mid_window_elsewhere(stage: int, directory: str, saved: list[torch.Tensor]) -> None:
    model, engine, _ = _build(stage, gas=4, seed=5)
    engine.load_checkpoint(directory, tag="mid")
    assert engine.gradient_state is zerodp.GradientState.ACCUMULATED
    for index, (param, grad) in enumerate(zip(model.parameters(), saved, strict=True)):
        # The average of the saving ranks' sums: the boundary's reduction, done at load.
        torch.testing.assert_close(zerodp.utils.safe_get_full_grad(param), grad, msg=str(index))
    engine.destroy()


def test_a_window_s_gradients_reshard(pools, tmp_path) -> None:
    """Local sums (stage 1) load at stage 3 on 3 ranks; averaged shards (stage 3) at stage 0
    on 1 rank: the kept gradient equals the saving run's averaged gradient."""
    for save_stage, load_stage, world_size in ((1, 3, 3), (3, 0, 1)):
        directory = str(tmp_path / f"s{save_stage}")
        saved = pools(2).run(save_mid_window, save_stage, directory)[0]
        pools(world_size).run(load_mid_window_elsewhere, load_stage, directory, saved)


def _fp16_build(stage: int, gas: int, scale_power: int, seed: int = 0):
    return _build(stage, gas, seed=seed, dtype="fp16", loss_scale_power=scale_power)


def _fp16_micro_steps(engine, loader, count: int) -> None:
    """`count` micro-steps of the fp16 model (its inputs cast to fp16)."""
    done = 0
    while done < count:
        for (x,) in loader:
            engine.backward(engine(x.half()).float().square().mean())
            engine.step()
            done += 1
            if done == count:
                return


def window_under_other_settings(stage: int, directory: str) -> dict[str, Any]:
    """A window saved under fp16 (accumulation 2, loss scale 2^8), loaded where the engine
    accumulates 4 (refused, nothing changed), and where its loss scale is 2^4: with the
    optimizer state (the saved scale comes back: the resumed run is the straight one) and
    without it (the engine keeps 2^4: the kept gradients are rescaled to it)."""
    model, engine, loader = _fp16_build(stage, gas=2, scale_power=8)
    _fp16_micro_steps(engine, loader, 3)  # one boundary, then a window begun
    engine.save_checkpoint(directory, tag="mid")
    saved_grads = [zerodp.utils.safe_get_full_grad(p) for p in model.parameters()]
    saved_scale = engine.loss_scale
    _fp16_micro_steps(engine, loader, 1)
    straight = _state(model, engine)
    engine.destroy()

    model, engine, _ = _fp16_build(stage, gas=4, scale_power=8, seed=3)
    before = _state(model, engine)
    with pytest.raises(zerodp.CheckpointError) as error:
        engine.load_checkpoint(directory, tag="mid")
    _assert_same(before, _state(model, engine), "after a load refused for its accumulation")
    engine.destroy()

    model, engine, loader = _fp16_build(stage, gas=2, scale_power=4, seed=3)
    engine.load_checkpoint(directory, tag="mid")
    scale_with_optimizer = engine.loss_scale
    _fp16_micro_steps(engine, loader, 1)
    _assert_same(straight, _state(model, engine), f"stage {stage}: resumed under another scale")
    engine.destroy()

    model, engine, _ = _fp16_build(stage, gas=2, scale_power=4, seed=3)
    engine.load_checkpoint(directory, tag="mid", load_optimizer_states=False)
    scale_without_optimizer = engine.loss_scale
    for index, (param, grad) in enumerate(zip(model.parameters(), saved_grads, strict=True)):
        # The accessor unscales by the engine's scale: equal only if the load rescaled.
        got = zerodp.utils.safe_get_full_grad(param)
        assert torch.equal(got, grad), f"stage {stage}: gradient {index} not rescaled"
    engine.destroy()
    return {
        "refused": str(error.value),
        "scales": (saved_scale, scale_with_optimizer, scale_without_optimizer),
    }


def test_a_window_loads_only_with_its_accumulation_and_follows_the_loss_scale(
    pools, tmp_path
) -> None:
    for stage in (1, 3):
        results = pools(2).run(window_under_other_settings, stage, str(tmp_path / f"s{stage}"))
        assert results[0] == results[1]
        message = results[0]["refused"]
        assert "accumulation window of 2 micro-steps" in message, message
        assert "set gradient_accumulation_steps to 2" in message, message
        assert "checkpoint saved at an accumulation boundary" in message, message
        assert results[0]["scales"] == (2.0**8, 2.0**8, 2.0**4)


# -- 1. nothing in a checkpoint runs ------------------------------------------------------


class Payload:
    """What an attacker plants: unpickling it creates `marker` (and would run anything)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def save_small(stage: int, directory: str, tag: str = "good") -> list[torch.Tensor]:
    model, engine, loader = _build(stage)
    _micro_steps(engine, loader, 2)
    engine.save_checkpoint(directory, tag=tag)
    params = [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
    engine.destroy()
    return params


def load_each(directories: list[str], verify: bool) -> list[str]:
    """Load every directory's `latest`; each must fail with a CheckpointError."""
    _, engine, _ = _build(3, seed=3)
    before = _state(engine.module, engine)
    messages = []
    for directory in directories:
        with pytest.raises(zerodp.CheckpointError) as error:
            engine.load_checkpoint(directory, verify_checksums=verify)
        messages.append(str(error.value))
    _assert_same(before, _state(engine.module, engine), "after refused loads")
    engine.destroy()
    return messages


def _plant(tmp_path: Path, good: Path, name: str, marker: Path, case: str) -> Path:
    directory = tmp_path / case
    shutil.copytree(good, directory)
    target = directory / "good" / name if name != "latest" else directory / name
    target.write_bytes(pickle.dumps(Payload(str(marker))))
    return directory


def test_planted_pickles_never_run(pools, tmp_path) -> None:
    good = tmp_path / "checkpoints"
    pools(2).run(save_small, 3, str(good))
    names = [*sorted(p.name for p in (good / "good").iterdir()), "latest"]
    assert ".metadata" in names and "checksums.json" in names
    assert any(n.endswith(".distcp") for n in names)
    marker = tmp_path / "payload_ran"
    for verify in (True, False):
        read = [n for n in names if verify or n != "checksums.json"]  # unread when not verifying
        cases = {name: _plant(tmp_path, good, name, marker, f"{name}-{verify}") for name in read}
        messages = pools(2).run(load_each, [str(d) for d in cases.values()], verify)
        for rank_messages in messages:
            for name, message in zip(cases, rank_messages, strict=True):
                assert name in message, (name, verify, message)
        assert messages[0] == messages[1]
        assert not marker.exists()

    # `zerodp consolidate` reads the same files: none of them runs either.
    from zerodp.checkpoint_io.consolidate import full_state_dict_from_checkpoint

    for name in [n for n in names if not n.startswith("rank")]:  # it reads no rank file
        for verify in (True, False) if name != "checksums.json" else (True,):
            directory = tmp_path / f"{name}-{verify}"
            with pytest.raises(zerodp.CheckpointError, match=name.replace(".", r"\.")):
                full_state_dict_from_checkpoint(directory, verify_checksums=verify)
    result = subprocess.run(
        [sys.executable, "-m", "zerodp.launch.cli", "consolidate", "--no-verify",
         str(tmp_path / ".metadata-False"), str(tmp_path / "out.pt")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1 and ".metadata" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists()


# -- 2. a flipped byte is a named error, and the engine is untouched -----------------------


def _chunk_of(checkpoint: Path, key: str) -> tuple[Path, int, int]:
    metadata = read_metadata(checkpoint)
    for index, info in metadata.storage_data.items():
        if index.fqn == key:
            return checkpoint / info.relative_path, info.offset, info.length
    raise KeyError(key)


def load_flipped(directory: str) -> str:
    _, engine, _ = _build(1, seed=3)
    before = _state(engine.module, engine)
    with pytest.raises(zerodp.CheckpointError) as error:
        engine.load_checkpoint(directory)
    _assert_same(before, _state(engine.module, engine), "after a refused load")
    engine.destroy()
    return str(error.value)


def test_a_flipped_byte_is_a_named_error_and_changes_nothing(pools, tmp_path) -> None:
    good = tmp_path / "good_run"
    pools(2).run(save_small, 1, str(good))
    for key in (
        "model.body.fc1.weight",
        "optim.body.fc2.weight.exp_avg",
        "optim.body.fc1.bias.step",
    ):
        directory = tmp_path / key
        shutil.copytree(good, directory)
        file, offset, length = _chunk_of(directory / "good", key)
        data = bytearray(file.read_bytes())
        data[offset + length - 3] ^= 0x10  # inside the tensor's bytes, near the chunk's end
        file.write_bytes(bytes(data))
        messages = pools(2).run(load_flipped, str(directory))
        assert messages[0] == messages[1]
        assert file.name in messages[0] and f"'{key}'" in messages[0], messages[0]


# -- 4. a kill at every step of the commit leaves `latest` loadable ------------------------


def save_versions(directory: str) -> dict[str, list[torch.Tensor]]:
    """Two states of one run, saved as tags 'a' (twice: 'a' is then overwritten) and 'b'."""
    model, engine, loader = _build(2)
    _micro_steps(engine, loader, 2)
    engine.save_checkpoint(directory, tag="a")
    first = [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
    _micro_steps(engine, loader, 1)
    engine.save_checkpoint(directory, tag="b")
    second = [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
    engine.destroy()
    return {"first": first, "second": second}


# The commit steps each kind of commit passes, in order (see [Note: atomic commit] in
# zerodp.checkpoint_io.paths): a new tag is renamed into place; an existing one is exchanged with
# the new copy, or, where the file system cannot exchange, renamed aside first.
COMMIT_PATHS = {
    "new": ("written", "renamed", "latest_staged", "latest_replaced", "old_removed"),
    "existing": ("written", "swapped", "latest_staged", "latest_replaced", "old_removed"),
    "existing-rename": (
        "written",
        "displaced",
        "renamed",
        "latest_staged",
        "latest_replaced",
        "old_removed",
    ),
}
KILLED = 9  # the exit status of a child killed at its step; a finished commit exits 0


def _kill_inside_commit(
    directory: Path, temp_name: str, tag: str, step: str, exchange: bool
) -> list[str]:
    """Commit `temp_name` as `tag` in a forked child that dies at `step`; returns the steps
    the child reached, in order (through a pipe: written as they happen, so they survive
    the death). Fails unless the child really died there."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a real process death, no cleanup of any kind
        os.close(reader)
        paths._Exchange.disabled = not exchange

        def die(name: str) -> None:
            os.write(writer, f"{name}\n".encode())
            if name == step:
                os._exit(KILLED)

        paths.on_commit_step = die
        paths.commit(directory, temp_name, tag)
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        reached = pipe.read().decode().split()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code == KILLED, f"{directory.name}: the commit was not killed at {step!r} ({reached})"
    assert reached and reached[-1] == step, (directory.name, reached)
    return reached


def load_latest_and_save_again(directories: list[str]) -> list[list[torch.Tensor]]:
    out = []
    for directory in directories:
        model, engine, _ = _build(2, seed=11)
        engine.load_checkpoint(directory)
        out.append([zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()])
        engine.save_checkpoint(directory, tag="after")  # a successful save cleans up
        engine.destroy()
    return out


def test_a_kill_at_any_commit_step_keeps_latest_loadable(pools, tmp_path) -> None:
    source = tmp_path / "source"
    versions = pools(2).run(save_versions, str(source))[0]
    assert any(not torch.equal(a, b) for a, b in zip(*versions.values(), strict=True))
    commit_paths = dict(COMMIT_PATHS)
    probe_a, probe_b = tmp_path / "probe-a", tmp_path / "probe-b"
    probe_a.mkdir(), probe_b.mkdir()
    if paths._exchange(probe_a, probe_b):
        # Every step of the protocol is a kill point of some kind of commit.
        assert {s for steps in commit_paths.values() for s in steps} == set(paths.COMMIT_STEPS)
    else:  # this file system cannot exchange: an existing tag takes the rename path
        commit_paths["existing"] = COMMIT_PATHS["existing-rename"]
    cases: dict[str, tuple[Path, str]] = {}
    for kind, steps in commit_paths.items():
        for step in steps:
            directory = tmp_path / f"{kind}-{step}"
            directory.mkdir()
            shutil.copytree(source / "a", directory / "a")
            paths.write_latest(directory, "a")
            tag = "c" if kind == "new" else "a"
            temp_name = paths.new_temp_name(tag)
            shutil.copytree(source / "b", directory / temp_name)  # a finished save of 'b'
            reached = _kill_inside_commit(
                directory, temp_name, tag, step, exchange=kind != "existing-rename"
            )
            # The child took this kind's path up to the step it died at, and no other.
            assert tuple(reached) == steps[: steps.index(step) + 1], (kind, step, reached)
            cases[f"{kind}-{step}"] = (directory, tag)
    loaded = pools(2).run(load_latest_and_save_again, [str(d) for d, _ in cases.values()])[0]
    for (name, (directory, _tag)), params in zip(cases.items(), loaded, strict=True):
        matches = [
            label
            for label, values in versions.items()
            if all(torch.equal(x, y) for x, y in zip(params, values, strict=True))
        ]
        assert matches, f"{name}: 'latest' loaded neither the old nor the new checkpoint"
        leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".tmp.")]
        assert leftovers == [], (name, leftovers)
        assert (directory / "latest").read_text() == "after"


# -- 6. a full disk: the same CheckpointError on every rank, training goes on ---------------


def _fill_disk_on(rank: int, where: str):
    """Make writes of this rank fail with ENOSPC, as on a full disk; returns the undo."""
    from torch.distributed.checkpoint import filesystem

    from zerodp.checkpoint_io import json_state

    originals = (filesystem.FileSystem.create_stream, json_state.write_file_synced)
    if dist.get_rank() != rank:
        return lambda: None

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "tensors":
        filesystem.FileSystem.create_stream = lambda self, path, mode: (  # type: ignore[method-assign]
            no_space() if "w" in mode else originals[0](self, path, mode)
        )
    else:
        json_state.write_file_synced = no_space  # type: ignore[assignment]

    def undo() -> None:
        filesystem.FileSystem.create_stream = originals[0]  # type: ignore[method-assign]
        json_state.write_file_synced = originals[1]

    return undo


def save_on_a_full_disk(directory: str) -> list[str]:
    model, engine, loader = _build(3)
    _micro_steps(engine, loader, 2)
    engine.save_checkpoint(directory, tag="before")
    messages = []
    for rank, where in ((1, "tensors"), (0, "json")):
        undo = _fill_disk_on(rank, where)
        try:
            engine.save_checkpoint(directory, tag="full")
        except Exception as error:  # what a training loop catches: CheckpointError is one
            assert isinstance(error, zerodp.CheckpointError)
            messages.append(str(error))
        finally:
            undo()
        _micro_steps(engine, loader, 1)  # training goes on
    assert sorted(p.name for p in Path(directory).iterdir()) == ["before", "latest"]
    engine.save_checkpoint(directory, tag="later")
    expected = [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
    engine.destroy()
    model, engine, _ = _build(3, seed=9)
    engine.load_checkpoint(directory)
    for x, y in zip(model.parameters(), expected, strict=True):
        assert torch.equal(zerodp.utils.safe_get_full_fp32_param(x), y)
    engine.destroy()
    return messages


def test_a_full_disk_is_one_error_on_every_rank(pools, tmp_path) -> None:
    messages = pools(2).run(save_on_a_full_disk, str(tmp_path / "ckpt"), timeout_s=120)
    assert messages[0] == messages[1] and len(messages[0]) == 2
    for message in messages[0]:
        assert "No space left on device" in message and "training can go on" in message
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["before", "later", "latest"], names


# -- 5. validate before mutate: optimizer switch, damaged JSON values ----------------------


def load_refused(directory: str, tag: str, optimizer: str) -> str:
    _, engine, _ = _build(1, seed=3, optimizer=optimizer)
    before = _state(engine.module, engine) if optimizer != "SGD" else None
    with pytest.raises(zerodp.CheckpointError) as error:
        engine.load_checkpoint(directory, tag=tag)
    if before is not None:
        _assert_same(before, _state(engine.module, engine), "after a refused load")
    engine.destroy()
    return str(error.value)


def load_weights_into_sgd(directory: str) -> list[torch.Tensor]:
    model, engine, _ = _build(1, seed=3, optimizer="SGD")
    engine.load_checkpoint(directory, tag="good", load_optimizer_states=False)
    assert engine.optimizer.param_groups[0]["weight_decay"] == 0  # SGD's own, not AdamW's
    params = [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
    engine.destroy()
    return params


def _edit_state(directory: Path, edit) -> None:
    """Change zerodp_state.json and keep its checksum right: only the schema check is left."""
    from zerodp.checkpoint_io import checksums

    state_file = directory / "good" / "zerodp_state.json"
    state = json.loads(state_file.read_text())
    edit(state)
    state_file.write_text(json.dumps(state))
    manifest_file = directory / "good" / "checksums.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["files"]["zerodp_state.json"] = checksums.small_file_entry(state_file)
    manifest_file.write_text(json.dumps(manifest))


def test_every_check_runs_before_anything_changes(pools, tmp_path) -> None:
    good = tmp_path / "good_run"
    saved = pools(2).run(save_small, 1, str(good))[0]
    messages = pools(2).run(load_refused, str(good), "good", "SGD")
    assert messages[0] == messages[1]
    assert "AdamW" in messages[0] and "SGD" in messages[0]
    assert "load_optimizer_states=False" in messages[0]
    weights = pools(2).run(load_weights_into_sgd, str(good))[0]
    assert all(torch.equal(w, s) for w, s in zip(weights, saved, strict=True))

    edits = {
        "lr": (lambda s: s["optimizer"]["param_groups"][0].update(lr="abc"), "'lr'"),
        "counters": (lambda s: s.pop("counters"), "'counters' is missing"),
        "betas": (lambda s: s["optimizer"]["param_groups"][0].pop("betas"), "betas"),
        "loader": (lambda s: s["dataloader"].update(epoch=-1), "dataloader"),
        "scheduler": (lambda s: s["lr_scheduler"].update(last_epoch="x"), "last_epoch"),
        "scale": (lambda s: s["loss_scaler"].update(scale=float("nan")), "'scale'"),
    }
    for name, (edit, expected) in edits.items():
        directory = tmp_path / name
        shutil.copytree(good, directory)
        _edit_state(directory, edit)
        messages = pools(2).run(load_refused, str(directory), "good", "AdamW")
        assert messages[0] == messages[1] and expected in messages[0], (name, messages[0])

    missing = tmp_path / "rank_file"
    shutil.copytree(good, missing)
    (missing / "good" / "rank1.json").unlink()
    messages = pools(2).run(load_refused, str(missing), "good", "AdamW")
    assert messages[0] == messages[1] and "rank1.json" in messages[0] and "missing" in messages[0]
