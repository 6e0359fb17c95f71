"""Post-training at world size 2: weight streaming and state offload.

- `engine.full_parameters()` yields every tensor of the state dict once (tied ones under
  their first name), equal to `engine.state_dict()`'s, in buckets whose bytes are measured
  from the communication counters and bounded by `bucket_bytes` (or the largest tensor);
  no parameter is gathered on the way. With PEFT LoRA adapters it yields what
  `merge_and_unload().state_dict()` holds in a single-process PEFT model built alike.
- `offload_states()` / `reload_states()`: the round trip leaves every tensor of model
  state bitwise as it was, the next step equals a run without it, the accounting moves
  every byte to the host side while offloaded, and what needs the states is refused
  (a forward, full_parameters, step, zero_grad, backward, gathered_for_generation, a
  checkpoint save); `destroy()` while offloaded brings them back first; optimizer state
  the config keeps on the host (`offload_optimizer`) stays where it is, and a forward's
  graph alive across the round trip backpropagates exactly.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.hf_models import VOCAB, build_llama
from zerodp.comm import CollectiveKind
from zerodp.zero import ParamStatus

BUCKET_BYTES = 4096


def _ids(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(17 * dist.get_rank() + step)
    return torch.randint(3, VOCAB, (2, 8), generator=generator)


def _first_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The state dict's names, a tied tensor under its first name only."""
    seen: set[int] = set()
    names = []
    for name, tensor in state.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            names.append(name)
    return names


def _train(engine: zerodp.ZeroEngine, steps: range) -> None:
    for step in steps:
        ids = _ids(step)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


# -- full_parameters -------------------------------------------------------------------


def streaming_cases(stage: int) -> dict[str, int]:
    model = build_llama()
    config = zerodp_config(
        stage,
        micro_batch=2,
        optimizer=optimizer_config("AdamW", lr=1e-2),
        dtype="bf16",
        persistence_threshold=64,  # norms stay whole (copied locally), matrices sharded
    )
    engine, *_ = zerodp.initialize(model=model, config=config)
    _train(engine, range(2))
    expected = engine.state_dict()
    names = _first_names(model.state_dict(keep_vars=True))
    sharded = [p for p in model.parameters() if not zerodp.zero.is_persistent(p)]
    stats = engine.comm.stats
    stream = engine.full_parameters(bucket_bytes=BUCKET_BYTES)
    got: dict[str, torch.Tensor] = {}
    largest = max(t.numel() * t.element_size() for t in expected.values())
    start = counted = stats.bytes[CollectiveKind.BROADCAST]
    for bucket in stream.buckets():
        sent = stats.bytes[CollectiveKind.BROADCAST] - counted  # this bucket's
        counted += sent
        assert sent <= max(BUCKET_BYTES, largest), (sent, BUCKET_BYTES, largest)
        assert all(engine.param_status(p) is ParamStatus.NOT_AVAILABLE for p in sharded)
        got.update(bucket)
    sent_total = counted - start
    assert sorted(got) == sorted(names), sorted(set(got) ^ set(names))
    for name, value in got.items():
        assert value.dtype == torch.bfloat16, name
        assert torch.equal(value, expected[name]), name
    sharded_bytes = sum(p.numel() * p.element_size() for p in sharded)
    if stage == 3:
        assert sent_total == sharded_bytes, (sent_total, sharded_bytes)  # each element once
    else:
        assert sent_total == 0 and not sharded
    report = stream.report
    assert report.num_buckets > 3, report
    assert report.peak_bucket_bytes <= max(BUCKET_BYTES, largest), report
    cast = dict(engine.full_parameters(dtype=torch.float32))
    assert all(torch.equal(cast[n], expected[n].float()) for n in names)
    engine.destroy()
    return {"buckets": report.num_buckets, "peak": report.peak_bucket_bytes, "sent": sent_total}


@pytest.mark.parametrize("stage", [1, 3])
def test_full_parameters_equal_the_state_dict_within_the_bucket_bound(pools, stage: int) -> None:
    results = pools(2).run(streaming_cases, stage)
    assert results[0] == results[1]


def _peft_model(seed: int) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    base = build_llama()
    torch.manual_seed(seed)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        modules_to_save=["norm"],
        init_lora_weights=False,  # random B: the deltas are not zero
    )
    model = get_peft_model(base, lora)
    with torch.no_grad():  # the saved copy differs from the original it replaces
        for name, param in model.named_parameters():
            if ".modules_to_save.default." in name:
                param.add_(0.5)
    return model


def merged_streaming_cases(stage: int, sequence: int = 1) -> int:
    reference = _peft_model(seed=5).merge_and_unload().state_dict(keep_vars=True)
    model = _peft_model(seed=5)
    config = zerodp_config(
        stage, micro_batch=2, optimizer=optimizer_config("AdamW", lr=1e-2), persistence_threshold=0
    )
    config["sequence_parallel_size"] = sequence
    engine, *_ = zerodp.initialize(model=model, config=config)
    before = [engine.param_status(p) for p in model.parameters()]
    got = dict(engine.full_parameters(bucket_bytes=BUCKET_BYTES, merge_adapters=True))
    assert [engine.param_status(p) for p in model.parameters()] == before
    assert sorted(got) == sorted(_first_names(reference)), sorted(set(got) ^ set(reference))
    for name, value in got.items():
        assert torch.equal(value, reference[name].detach()), name
    unmerged = dict(engine.full_parameters(bucket_bytes=BUCKET_BYTES))
    assert any("lora_A" in n for n in unmerged)
    engine.destroy()
    return len(got)


@pytest.mark.parametrize(("stage", "sequence"), [(1, 1), (3, 1), (3, 2)])
def test_full_parameters_merge_lora_adapters_as_peft_does(pools, stage: int, sequence: int) -> None:
    """With sequence parallelism too (S = 2: the shard group is the sequence group)."""
    pytest.importorskip("peft")
    pools(2).run(merged_streaming_cases, stage, sequence)


# -- offload_states / reload_states ----------------------------------------------------


def _local_state(engine: zerodp.ZeroEngine) -> list[torch.Tensor]:
    """Every tensor of model state this rank holds (shards, masters, kept gradients, moments)."""
    tensors: list[torch.Tensor] = []
    for state in engine.groups:
        tensors.append(state.flat.shard)
        if state.gather is None:
            tensors.append(state.flat.full)
        if state.optim is not None:
            tensors.append(state.optim.param)
        if state.grads is not None:
            tensors.append(state.grads.storage)
    for slots in engine.optimizer.state.values():
        tensors += [v for v in slots.values() if torch.is_tensor(v)]
    return [t.detach().clone() for t in tensors]


def _run(stage: int, dtype: str, offload: bool) -> tuple[list[torch.Tensor], list[str]]:
    config = zerodp_config(
        stage,
        micro_batch=2,
        optimizer=optimizer_config("AdamW", lr=1e-2),
        dtype=dtype,
        persistence_threshold=64,
    )
    engine, *_ = zerodp.initialize(model=build_llama(), config=config)
    _train(engine, range(2))
    ids = _ids(2)
    engine.backward(engine(input_ids=ids, labels=ids).loss)  # kept gradients hold something
    refusals: list[str] = []
    if offload:
        snapshot = _local_state(engine)
        held = engine.model_state_bytes()
        engine.offload_states()
        moved = engine.model_state_bytes()
        assert moved.device_total == 0, moved
        assert moved.host_total == held.total, (moved, held)
        refusals = _refusals(
            lambda: engine(input_ids=ids),
            lambda: list(engine.full_parameters()),
            engine.step,
            engine.zero_grad,
            lambda: engine.backward(torch.zeros((), requires_grad=True)),
            lambda: _enter(engine.gathered_for_generation()),
            lambda: _save_checkpoint(engine),
        )
        engine.reload_states()
        assert engine.model_state_bytes() == held
        for before, after in zip(snapshot, _local_state(engine), strict=True):
            assert torch.equal(before, after)
        engine.offload_states(include=["optim_states", "hp_params"])  # a rollout's offload
        with engine.gathered_for_generation():
            engine(input_ids=ids)  # parameters stay: forwards run
        refusals += _refusals(engine.step)  # the step needs them
        engine.reload_states()
    engine.step()
    _train(engine, range(3, 4))
    weights = [t.clone() for t in engine.state_dict().values()]
    engine.destroy()
    return weights, refusals


def _refusals(*calls: Callable[[], object]) -> list[str]:
    """The message of each call's UsageError (a call that does not raise adds nothing)."""
    messages = []
    for call in calls:
        try:
            call()
        except zerodp.UsageError as error:
            messages.append(str(error))
    return messages


def _enter(context: Any) -> None:
    with context:
        pass


def _save_checkpoint(engine: zerodp.ZeroEngine) -> None:
    with tempfile.TemporaryDirectory() as directory:
        engine.save_checkpoint(directory)


def _destroy_while_offloaded(stage: int, dtype: str) -> None:
    """destroy() brings the states back first: the module's logits are those before."""
    config = zerodp_config(
        stage, micro_batch=2, optimizer=optimizer_config("AdamW", lr=1e-2), dtype=dtype
    )
    engine, *_ = zerodp.initialize(model=build_llama(), config=config)
    _train(engine, range(1))
    ids = _ids(9)
    with torch.no_grad():
        before = engine(input_ids=ids).logits
    engine.offload_states()
    engine.destroy()
    with torch.no_grad():
        after = engine.module(input_ids=ids).logits
    assert torch.equal(before, after), "the module after destroy() is not the trained one"


def offload_round_trip(stage: int, dtype: str) -> list[str]:
    plain, _ = _run(stage, dtype, offload=False)
    offloaded, refusals = _run(stage, dtype, offload=True)
    for a, b in zip(plain, offloaded, strict=True):
        assert torch.equal(a, b), "a step after offload_states/reload_states differs"
    _destroy_while_offloaded(stage, dtype)
    return refusals


@pytest.mark.parametrize(("stage", "dtype"), [(0, "fp32"), (1, "fp32"), (3, "bf16")])
def test_offload_round_trip_is_bitwise_and_training_continues(pools, stage, dtype) -> None:
    refusals = pools(2).run(offload_round_trip, stage, dtype)[0]
    assert len(refusals) == 8, refusals
    assert all("reload_states()" in message for message in refusals), refusals
    assert "lp_params" in refusals[0] and "optim_states" in refusals[7], refusals
    what = ["a forward", "full_parameters()", "step()", "zero_grad()", "backward()"]
    what += ["gathered_for_generation()", "checkpoint"]
    assert all(w in m for w, m in zip(what, refusals, strict=False)), refusals


def _optimizer_tensors(engine: zerodp.ZeroEngine) -> list[torch.Tensor]:
    slots = engine.optimizer.state.values()
    return [v for slot in slots for v in slot.values() if torch.is_tensor(v) and v.dim() > 0]


def _weights_after_a_step(offload_mid_graph: bool) -> list[torch.Tensor]:
    """One step whose forward's graph is live while lp_params go to the host and back."""
    config = zerodp_config(1, micro_batch=2, optimizer=optimizer_config("AdamW", lr=1e-2))
    engine, *_ = zerodp.initialize(model=build_llama(), config=config)
    _train(engine, range(1))
    ids = _ids(5)
    loss = engine(input_ids=ids, labels=ids).loss  # its graph saved the parameters
    if offload_mid_graph:
        engine.offload_states(include=["lp_params"])
        engine.reload_states()
    engine.backward(loss)
    engine.step()
    weights = [t.clone() for t in engine.state_dict().values()]
    engine.destroy()
    return weights


def offload_edges() -> None:
    # Optimizer state the config keeps on the host stays where it is; the parameters move.
    config = zerodp_config(
        1,
        micro_batch=2,
        optimizer=optimizer_config("AdamW", lr=1e-2),
        zero={"offload_optimizer": {"device": "cpu"}},
    )
    engine, *_ = zerodp.initialize(model=build_llama(), config=config)
    _train(engine, range(1))
    moments = [t.data_ptr() for t in _optimizer_tensors(engine)]
    params = [p.data_ptr() for p in engine.module.parameters()]
    assert moments
    engine.offload_states()
    assert [t.data_ptr() for t in _optimizer_tensors(engine)] == moments
    assert [p.data_ptr() for p in engine.module.parameters()] != params
    engine.reload_states()
    engine.destroy()
    # A graph that saved the parameters before they moved still backpropagates exactly.
    for a, b in zip(_weights_after_a_step(False), _weights_after_a_step(True), strict=True):
        assert torch.equal(a, b), "the backward of a graph alive across offload differs"


def test_offload_leaves_config_offloaded_state_and_live_graphs_intact(pools) -> None:
    pools(2).run(offload_edges)


def test_stream_weights_example_syncs_a_server(pools) -> None:
    """examples/stream_weights.py, one round: the server's tokens equal the trainers'."""
    from examples import stream_weights

    lines = pools(2).run(stream_weights.run, 1)[0]
    assert len(lines) == 1 and lines[0].endswith("equal the trainers': True"), lines
