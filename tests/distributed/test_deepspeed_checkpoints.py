"""DeepSpeed's own ZeRO checkpoints load into zerodp and continue as DeepSpeed continued them.

The fixtures in tests/data/deepspeed_checkpoints were written by DeepSpeed
0.19.8 itself (tools/make_deepspeed_fixtures.py): the run of
tests/deepspeed_run.py at world size 2, for ZeRO stages 1-3 in fp32, bf16 and
fp16, saved after 3 steps, with DeepSpeed's next 3 steps recorded (global mean
loss, lr, loss scale, and every parameter's fp32 master and Adam moments, read
through DeepSpeed's accessors). Three (stage 1 fp16, stage 2 fp32, stage 3
bf16) are also converted by DeepSpeed's `ds_to_universal`; those cases load the
universal folder as a DeepSpeed run would, through `checkpoint.load_universal`
and `latest_universal` (the ZeRO folder's `latest` sits beside it).

zerodp at world sizes 1, 2 and 3 (and every zerodp stage, 0-3, across the
cases) loads each one and must hold exactly DeepSpeed's fp32 masters, Adam
moments and training-dtype weights (element for element), its counters, lr,
loss scale and client state, and then take the same 3 steps:

- fp32: losses, masters and moments within 1e-6 (only the order of the
  gradient sums differs).
- bf16 / fp16 (`half_bound`): the forward and backward run in half precision,
  and at world sizes 1 and 3 the global batch of 6 is split differently than
  DeepSpeed's 3 + 3, so each step's gradient is rounded differently. Take its
  error as delta = 16 u per element (u, the format's unit round-off: 2^-8
  bf16, 2^-11 fp16; 16 rounded operations is a generous count for this
  4-layer net), relative to gradients of at most 1 (they are clipped to norm
  1). Adam's update m_hat / sqrt(v_hat) moves by at most
  (1 - b1) / (1 - b1^t) * sqrt((1 - b2^t) / (1 - b2)) * delta <= 0.7 delta
  for betas (0.9, 0.95) and steps t = 4..6, so masters stay within
  3 steps * 0.7 * lr_max * delta; the moments are averages of the gradients
  (and of their squares, whose error is at most 2 delta), so they stay within
  3 * (1 - b1) * delta and 3 * (1 - b2) * 2 delta; the loss, computed from
  half-precision outputs, within delta relative. At world size 2 the split is
  DeepSpeed's own and zerodp agrees to fp32 round-off.
- DeepSpeed 0.19.8's fp16 ZeRO optimizers raise the loss scale before they
  unscale the gradients, so the step on which the scale grows applies half
  the gradient (its clipping sees half the norm too). zerodp unscales by the
  scale the loss was multiplied with. The fp16 fixtures' continuation has such
  a step; there zerodp is given half the loss, which reproduces DeepSpeed's
  update exactly and keeps every other difference visible.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests import deepspeed_run as run
from zerodp.checkpoint_io.deepspeed.unpickle import read_pickle
from zerodp.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests/data/deepspeed_checkpoints"
TAG = f"global_step{run.SAVED_AT}"
UNIVERSAL_TAG = f"{TAG}_universal"
CASES = [(stage, precision, None) for stage in run.STAGES for precision in run.PRECISIONS] + [
    (stage, precision, UNIVERSAL_TAG) for stage, precision in run.UNIVERSAL
]
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
FP32_BOUND = 1e-6


def half_bound(precision: str) -> dict[str, float]:
    """Per-element bounds after the 3 continued steps (see the module docstring)."""
    delta = 16 * UNIT_ROUNDOFF[precision]
    b1, b2, lr_max = 0.9, 0.95, 0.02
    return {
        "fp32": 3 * 0.7 * lr_max * delta,
        "exp_avg": 3 * (1 - b1) * delta,
        "exp_avg_sq": 3 * (1 - b2) * 2 * delta,
        "loss": delta,  # relative
    }


def zerodp_stage(ds_stage: int, world_size: int) -> int:
    """Like for like at DeepSpeed's world size; other stages elsewhere (all four appear)."""
    return ds_stage if world_size == 2 else (ds_stage + world_size) % 4


def expected(stage: int, precision: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors import safe_open

    path = FIXTURES / run.fixture_name(stage, precision) / "expected.safetensors"
    with safe_open(str(path), "pt") as file:
        record = json.loads(file.metadata()["record"])
        return {key: file.get_tensor(key) for key in file.keys()}, record  # noqa: SIM118


def _build(
    stage: int, precision: str, zero_stage: int, load_universal: bool = False
) -> tuple[torch.nn.Module, Any]:
    world = dist.get_world_size()
    model = run.build_model()
    config = run.config(stage, precision, world)
    config["zero_optimization"] = {"stage": zero_stage}
    if load_universal:  # DeepSpeed's way to a universal checkpoint: `latest_universal`
        config["checkpoint"] = {"load_universal": True}
    engine, *_ = zerodp.initialize(
        model=model, model_parameters=run.param_groups(model), config=config
    )
    return model, engine


def _deviation(model: torch.nn.Module, want: dict[str, torch.Tensor], prefix: str) -> dict:
    """Largest |zerodp - DeepSpeed| per kind (masters, moments), over every trained parameter."""
    worst = {"fp32": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        values = {
            "fp32": zerodp.utils.safe_get_full_fp32_param(param),
            "exp_avg": zerodp.utils.safe_get_full_optimizer_state(param, "exp_avg"),
            "exp_avg_sq": zerodp.utils.safe_get_full_optimizer_state(param, "exp_avg_sq"),
        }
        for kind, value in values.items():
            diff = (value.float() - want[f"{prefix}.{kind}.{name}"]).abs().max().item()
            worst[kind] = max(worst[kind], diff)
    return worst


def _model_weights_equal(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> list[str]:
    """The parameters whose training-dtype weights differ from DeepSpeed's at the save."""
    with zerodp.zero.GatheredParameters(list(model.parameters())):
        return [
            name
            for name, param in model.named_parameters()
            if not torch.equal(param.detach(), want[f"saved.model.{name}"])
        ]


def continue_fixtures(cases: list[tuple[int, str, str | None]]) -> list[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for stage, precision, tag in cases:
        want, record = expected(stage, precision)
        zero_stage = zerodp_stage(stage, world)
        model, engine = _build(stage, precision, zero_stage, load_universal=tag is not None)
        folder = FIXTURES / run.fixture_name(stage, precision)
        path, client = engine.load_checkpoint(str(folder))
        result: dict[str, Any] = {
            "case": (stage, precision, tag, zero_stage, world),
            "path": Path(path).name,
            "client": client,
            "counters": (engine.global_steps, engine.micro_steps, engine.global_samples),
            "at_load": _deviation(model, want, "saved"),
            "weights_differ": _model_weights_equal(model, want),
            "report": str(engine.last_load_report),
            "steps": [],
        }
        for step in range(run.SAVED_AT + 1, run.SAVED_AT + run.CONTINUED + 1):
            x, y = run.rank_batch(step, rank, world)
            lr, scale = engine.get_lr(), engine.loss_scale
            loss = run.loss_of(engine(x), y)
            index = step - 1
            grows = record["loss_scales_after"][index] > record["loss_scales"][index]
            engine.backward(loss * 0.5 if grows else loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            result["steps"].append(
                {"lr": lr, "scale": scale, "loss": mean.item() / world}
                | _deviation(model, want, f"step{step}")
            )
        result["record"] = record
        engine.destroy()
        out.append(result)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_deepspeed_checkpoints_continue_exactly(pools, world_size: int) -> None:
    results = pools(world_size).run(continue_fixtures, CASES, timeout_s=600)[0]
    for result in results:
        stage, precision, tag, zero_stage, _ = result["case"]
        where = f"{run.fixture_name(stage, precision)} ({tag or TAG}) -> zerodp stage {zero_stage}"
        record = result["record"]
        assert result["path"] == (tag or TAG), where
        assert result["client"] == {"epoch": 4, "note": "fixture"}, where
        assert result["counters"] == (3, 3, 18), where
        # At the load: DeepSpeed's values, element for element.
        assert result["at_load"] == {"fp32": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}, where
        assert result["weights_differ"] == [], where
        report = result["report"]
        assert "Adam moments (exp_avg, exp_avg_sq) and step counts" in report, report
        assert "LR scheduler: last_batch_iteration 2" in report, report
        assert "random generator states (DeepSpeed does not save them)" in report, report
        bound = (
            dict.fromkeys(("fp32", "exp_avg", "exp_avg_sq", "loss"), FP32_BOUND)
            if precision == "fp32"
            else half_bound(precision)
        )
        for offset, step in enumerate(result["steps"]):
            index = run.SAVED_AT + offset
            assert step["lr"] == pytest.approx(record["lrs"][index], rel=1e-12), where
            assert step["scale"] == record["loss_scales"][index], where
            loss_bound = bound["loss"] * (
                abs(record["losses"][index]) if precision != "fp32" else 1
            )
            assert abs(step["loss"] - record["losses"][index]) <= loss_bound, (where, step)
            for kind in ("fp32", "exp_avg", "exp_avg_sq"):
                assert step[kind] <= bound[kind], (where, offset, kind, step[kind], bound[kind])


# -- nothing runs while reading -------------------------------------------------------------


class Payload:
    """What an attacker plants: unpickling it runs `touch marker`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _tampered_copy(directory: Path, marker: Path) -> Path:
    """stage2_fp32 with a payload planted in its model-states file's client state."""
    folder = directory / "tampered"
    shutil.copytree(FIXTURES / "stage2_fp32", folder)
    states = folder / TAG / "mp_rank_00_model_states.pt"
    data = dict(read_pickle(states))
    data["args"] = Payload(str(marker))
    torch.save(data, states)
    return folder


def load_tampered(folder: str) -> str:
    _, engine = _build(2, "fp32", 2)
    try:
        engine.load_checkpoint(folder)
    except CheckpointError as error:
        return str(error)
    finally:
        engine.destroy()
    return "loaded"


def test_a_planted_reduce_is_refused_without_running(pools, tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    folder = _tampered_copy(tmp_path, marker)
    messages = pools(2).run(load_tampered, str(folder))
    assert len(set(messages)) == 1, messages  # every rank, the same error
    assert "was refused: it asks to build 'posix.system'" in messages[0], messages[0]
    assert not marker.exists()
    # The payload is live: an unrestricted load runs it.
    torch.load(folder / TAG / "mp_rank_00_model_states.pt", weights_only=False)
    assert marker.exists()


# -- refusals name the fix; partial loads -----------------------------------------------------


def refusals(folder: str) -> dict[str, str]:
    """Each misuse, on every rank: the error's message (or 'loaded')."""

    def attempt(make: Any, **kwargs: Any) -> str:
        engine = make()
        try:
            engine.load_checkpoint(folder, **kwargs)
        except CheckpointError as error:
            return str(error)
        finally:
            engine.destroy()
        return "loaded"

    def other_shape() -> Any:
        model = run.build_model()
        model.head = torch.nn.Linear(9, 4)
        config = run.config(2, "fp32", dist.get_world_size())
        return zerodp.initialize(
            model=model, model_parameters=run.param_groups(model), config=config
        )[0]

    def sgd() -> Any:
        model = run.build_model()
        config = run.config(2, "fp32", dist.get_world_size())
        config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
        return zerodp.initialize(
            model=model, model_parameters=run.param_groups(model), config=config
        )[0]

    def one_group() -> Any:
        model = run.build_model()
        config = run.config(2, "fp32", dist.get_world_size())
        trainable = [p for p in model.parameters() if p.requires_grad]
        return zerodp.initialize(model=model, model_parameters=trainable, config=config)[0]

    return {
        "shape": attempt(other_shape),
        "sgd": attempt(sgd),
        "sgd_weights_only": attempt(sgd, load_optimizer_states=False),
        "groups": attempt(one_group),
        "missing_rank": attempt(lambda: _build(2, "fp32", 2)[1], tag="incomplete"),
    }


def test_refusals_name_the_fix_on_every_rank(pools, tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    shutil.copytree(FIXTURES / "stage2_fp32", folder)
    shutil.copytree(folder / TAG, folder / "incomplete")
    (folder / "incomplete" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    results = pools(2).run(refusals, str(folder))
    assert results[0] == results[1]
    found = results[0]
    assert "is for a different model" in found["shape"] and "head.weight" in found["shape"]
    assert "holds Adam state" in found["sgd"] and "load_optimizer_states=False" in found["sgd"]
    assert found["sgd_weights_only"] == "loaded"
    assert "param groups" in found["groups"] and "model_parameters" in found["groups"]
    assert "says 2 data-parallel ranks" in found["missing_rank"]


# -- zerodp convert deepspeed ------------------------------------------------------------------


def convert(source: str, destination: str, hf: str) -> int:
    from zerodp.launch.cli import main

    return main(
        ["convert", "deepspeed", source, destination, "--hf", hf, "--max-shard-bytes", "400"]
    )


def load_converted(destination: str, stage: int, precision: str) -> dict[str, Any]:
    want, _ = expected(stage, precision)
    model, engine = _build(stage, precision, 3)
    engine.load_checkpoint(destination)
    result = {
        "at_load": _deviation(model, want, "saved"),
        "counters": (engine.global_steps, engine.global_samples),
        "lr": engine.get_lr(),
    }
    engine.destroy()
    return result


def test_convert_writes_a_zerodp_checkpoint_and_safetensors(pools, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    stage, precision = 3, "bf16"
    source = FIXTURES / run.fixture_name(stage, precision)
    destination, hf = tmp_path / "zerodp", tmp_path / "hf"
    assert pools(1).run(convert, str(source), str(destination), str(hf))[0] == 0
    want, record = expected(stage, precision)
    results = pools(3).run(load_converted, str(destination), stage, precision)
    assert results[0]["at_load"] == {"fp32": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    assert results[0]["counters"] == (3, 18)
    assert results[0]["lr"] == pytest.approx(record["lrs"][run.SAVED_AT], rel=1e-12)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, as asked
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(hf / name)))
    model = run.build_model()
    assert set(tensors) == set(model.state_dict())
    for name, param in model.named_parameters():
        saved = want[f"saved.fp32.{name}"] if param.requires_grad else want[f"saved.model.{name}"]
        assert torch.equal(tensors[name], saved.float().reshape(param.shape)), name
    assert torch.equal(tensors["offset"], model.offset)


def convert_state_bytes(source: str, destination: str) -> dict[str, Any]:
    """`zerodp convert`'s one-process engine, read at its save: what it holds, and the model's
    elements (trainable, and all) from the stand-in it trained nothing on."""
    from zerodp.launch.convert import convert_deepspeed

    seen: dict[str, Any] = {}
    original = zerodp.ZeroEngine.save_checkpoint

    def save_and_count(engine: Any, *args: Any, **kwargs: Any) -> Any:
        memory = engine.model_state_bytes()
        params = list(engine.module.parameters())
        steps = [s["step"] for s in engine.optimizer.inner.state.values() if "step" in s]
        seen.update(
            params=memory.params,
            grads=memory.grads,
            optimizer=memory.optimizer,
            trainable=sum(p.numel() for p in params if p.requires_grad),
            numel=sum(p.numel() for p in params),
            dtype_bytes=params[0].element_size(),
            step_bytes=sum(step.numel() * step.element_size() for step in steps),
        )
        return original(engine, *args, **kwargs)

    zerodp.ZeroEngine.save_checkpoint = save_and_count  # type: ignore[method-assign]
    try:
        convert_deepspeed(source, destination)
    finally:
        zerodp.ZeroEngine.save_checkpoint = original  # type: ignore[method-assign]
    return seen


def test_convert_holds_16_bytes_a_trainable_parameter(pools, tmp_path: Path) -> None:
    """The one-process engine holds the whole training state: under bf16 the weights and a
    gradient buffer (2 + 2 bytes) and the fp32 master and Adam moments (12 bytes, the
    figure docs/deepspeed.md quotes); in fp32 the weights are the master (4 + 4 + 8). Frozen
    parameters add their weights only; Adam's step counts a few bytes."""
    for stage, precision in ((3, "bf16"), (2, "fp32")):
        source = FIXTURES / run.fixture_name(stage, precision)
        seen = pools(1).run(convert_state_bytes, str(source), str(tmp_path / precision))[0]
        trainable, width = seen["trainable"], seen["dtype_bytes"]
        assert width == (2 if precision == "bf16" else 4), seen
        assert 0 < trainable < seen["numel"], seen  # the fixture has frozen parameters too
        masters_and_moments = 12 if precision == "bf16" else 8
        assert seen["params"] == seen["numel"] * width, seen
        assert seen["grads"] == trainable * width, seen
        assert seen["optimizer"] == trainable * masters_and_moments + seen["step_bytes"], seen
        per_parameter = (seen["params"] + seen["grads"] + seen["optimizer"]) - seen["step_bytes"]
        frozen_bytes = (seen["numel"] - trainable) * width
        assert per_parameter - frozen_bytes == 16 * trainable, seen


# -- a conversion gives what a direct load gives ---------------------------------------------

# (fixture, ZeRO stage of the loading engine): a run's own optimizer, scheduler and rich
# client_state (stage 2 fp32), fp16's dynamic loss scaler (stage 1), bf16 at stage 3 (a
# cosine schedule, whose peak lr the scheduler takes from the optimizer), and stage2_fp32
# saved as if with 2 micro-batches per step (`GAS2`: DeepSpeed does not save micro-steps).
GAS2 = "stage2_fp32_gas2"
CONVERTED = [(run.CLIENT_FIXTURE, 3), ("stage1_fp16", 1), ("stage3_bf16", 0), (GAS2, 2)]


def _with_two_micro_batches(directory: Path) -> Path:
    """stage2_fp32 whose saved config says gradient_accumulation_steps 2."""
    folder = directory / GAS2
    shutil.copytree(FIXTURES / "stage2_fp32", folder)
    states = folder / TAG / "mp_rank_00_model_states.pt"
    data = dict(read_pickle(states))
    data["ds_config"] = {**data["ds_config"], "gradient_accumulation_steps": 2}
    torch.save(data, states)
    return folder


def _build_for(fixture: str, zero_stage: int) -> tuple[torch.nn.Module, Any]:
    """The engine the fixture's run would resume in (its own optimizer and scheduler for the
    client fixture), at `zero_stage`."""
    if fixture == GAS2:
        model = run.build_model()
        config = run.config(2, "fp32", dist.get_world_size())
        config["zero_optimization"] = {"stage": zero_stage}
        config["gradient_accumulation_steps"] = 2
        config["train_micro_batch_size_per_gpu"] //= 2
        engine, *_ = zerodp.initialize(
            model=model, model_parameters=run.param_groups(model), config=config
        )
        return model, engine
    if fixture != run.CLIENT_FIXTURE:
        stage, precision = int(fixture[5]), fixture.split("_")[1]
        return _build(stage, precision, zero_stage)
    model = run.build_model()
    config = run.client_config(dist.get_world_size())
    config["zero_optimization"] = {"stage": zero_stage}
    optimizer = run.client_optimizer(model)
    engine, *_ = zerodp.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=run.client_scheduler(optimizer),
        config=config,
    )
    return model, engine


def _everything_loaded(fixture: str, zero_stage: int, directory: str) -> dict[str, Any]:
    """All a load of `directory` gives an engine built for `fixture`'s run."""
    model, engine = _build_for(fixture, zero_stage)
    torch.manual_seed(1000 + dist.get_rank())
    generator_before = torch.get_rng_state()
    _, client = engine.load_checkpoint(directory)
    state: dict[str, Any] = {
        "client": client,
        "counters": engine.train_state.state_dict(),
        "lr": engine.get_lr(),
        "scheduler": engine.lr_scheduler.state_dict(),
        "loss_scaler": engine.optimizer.loss_scaler.state_dict(),
        "settings": [
            {k: v for k, v in group.items() if k != "params"}
            for group in engine.optimizer.param_groups
        ],
        "generator_untouched": torch.equal(torch.get_rng_state(), generator_before),
        "not_restored": list(engine.last_load_report.not_restored),
    }
    for name, param in model.named_parameters():
        if param.requires_grad:
            state[f"fp32.{name}"] = zerodp.utils.safe_get_full_fp32_param(param)
            for key in ("exp_avg", "exp_avg_sq"):
                value = zerodp.utils.safe_get_full_optimizer_state(param, key)
                state[f"{key}.{name}"] = value
    with zerodp.zero.GatheredParameters(list(model.parameters())):
        for name, tensor in model.state_dict().items():
            state[f"module.{name}"] = tensor.clone()
    engine.destroy()
    return state


def _convert_only(source: str, destination: str) -> str:
    from zerodp.launch.convert import convert_deepspeed

    return convert_deepspeed(source, destination)[0]


def _difference(a: Any, b: Any, where: str = "") -> str | None:
    """Where `a` and `b` first differ (kinds of containers included), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
        return None if same else f"{where}: {a!r} != {b!r}"
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} {a!r} != {type(b).__name__} {b!r}"
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(a)} != {sorted(b)}"
        found = (_difference(a[k], b[k], f"{where}[{k!r}]") for k in a)
        return next((d for d in found if d is not None), None)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} items != {len(b)}"
        pairs = enumerate(zip(a, b, strict=True))
        found = (_difference(x, y, f"{where}[{i}]") for i, (x, y) in pairs)
        return next((d for d in found if d is not None), None)
    return None if a == b else f"{where}: {a!r} != {b!r}"


def test_a_converted_checkpoint_loads_as_the_deepspeed_one_does(pools, tmp_path: Path) -> None:
    """Everything a direct load of the DeepSpeed checkpoint gives, a load of its conversion
    gives too: client_state (every plain kind, tensors included), counters, the LR
    scheduler's state (also a torch scheduler the run passed in itself), loss scaler,
    optimizer settings, masters and moments, frozen weights and buffers, micro-steps counted
    with the run's gradient accumulation; and, as DeepSpeed saves no random generator
    states, neither load touches the generators."""
    loaded = {}
    for fixture, zero_stage in CONVERTED:
        source = _with_two_micro_batches(tmp_path) if fixture == GAS2 else FIXTURES / fixture
        destination = str(tmp_path / "converted" / fixture)
        pools(1).run(_convert_only, str(source), destination)
        direct = pools(2).run(_everything_loaded, fixture, zero_stage, str(source))
        converted = pools(2).run(_everything_loaded, fixture, zero_stage, destination)
        for rank in range(2):
            a, b = direct[rank], converted[rank]
            assert a.keys() == b.keys(), fixture
            for key in a:
                if key != "not_restored":
                    assert _difference(a[key], b[key], key) is None, (fixture, rank)
            assert b["generator_untouched"], fixture
            for report in (a["not_restored"], b["not_restored"]):
                assert not [line for line in report if "scheduler" in line], (fixture, report)
                assert any("random generator" in line for line in report), (fixture, report)
        loaded[fixture] = direct[0]
    # What was compared is what the runs saved: the client run's state and its own StepLR.
    client_run = loaded[run.CLIENT_FIXTURE]
    assert _difference(client_run["client"], run.client_state()) is None, client_run["client"]
    assert client_run["scheduler"]["last_epoch"] == run.SAVED_AT
    for fixture in ("stage1_fp16", "stage3_bf16", GAS2):
        assert loaded[fixture]["client"] == {"epoch": 4, "note": "fixture"}, fixture
        assert loaded[fixture]["counters"]["global_steps"] == run.SAVED_AT, fixture
    assert loaded[GAS2]["counters"]["micro_steps"] == 2 * run.SAVED_AT  # a window's start
