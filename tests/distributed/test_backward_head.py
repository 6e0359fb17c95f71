"""Stage 3 keeps the head of a backward gathered only while a backward can still come.

At a forward's end, the groups its backward starts with stay gathered ([Note: kept for the
backward's head] in zerodp.stage3.forward_graphs). Every case measures, on every rank, which
parameters are AVAILABLE and the bytes gathered: the parameter bytes of
`engine.model_state_bytes()` above what the rank holds with everything released, and the
gatherer's live count, both against the sizes of the parameters expected to be kept. Stage 3
with every parameter sharded; `stage3_prefetch_bucket_size` is one output layer's size, so
the head is that layer alone.

- An inference engine (no optimizer) run under `no_grad`, then in grad mode: its output has
  no graph, so nothing stays gathered, with the output alive and after it is dropped; with
  an input that requires grad, the head stays until that output is dropped.
- A training engine's evaluation forward without `no_grad` (plain, reentrant and
  non-reentrant activation checkpointing, tied input and output embeddings): the head stays
  while the output, or a loss built from it, is alive, and goes when it is dropped.
- A training forward whose output is kept, then used for a backward: the head stays
  gathered until that backward, also while a second forward's output is dropped meanwhile
  (the first still awaits its backward), and the gradients and weights equal the
  data-parallel reference computed in the test (`tests.lockstep.Lockstep`).
- A backward that retains its graph, then a second through it: each keeps nothing gathered
  after it, the second gathers again what the first did (the same peak of gathered
  elements), and the gradients of both equal the reference's; dropping the retained graph
  then changes nothing. Two forwards, then their backwards, the later first: the head stays
  until the first backward, nothing after either, exact. An evaluation forward under
  `no_grad` keeps nothing, its output alive.
- Stages 0-2 keep every parameter whole through an evaluation forward with and without
  `no_grad`, its output alive and dropped, with the same bytes, and train exactly after it.
- Ranks that drop an evaluation output at different points: one has released the head,
  another keeps it; a full state dict (gathered group by group) still gathers alike on
  every rank, and equals the reference's weights.

The same cases run with shard groups and hpZ in tests/distributed/test_hybrid.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.lockstep import Lockstep
from tests.models import LifecycleNet, TiedLM, TinyNet, lifecycle_inputs, tiny_inputs, token_inputs
from zerodp.testing.parity import default_tolerance

ADAM = optimizer_config("Adam", lr=1e-2, adam_w_mode=False, fused=False)


def _reference_adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def _config(head: nn.Module, optimizer: dict[str, Any] | None, zero: dict[str, Any]) -> Any:
    """Stage 3, everything sharded, the backward's head the parameters of `head` alone."""
    bucket = sum(p.numel() for p in head.parameters())
    zero = {"stage3_prefetch_bucket_size": bucket, **zero}
    return zerodp_config(3, optimizer=optimizer, persistence_threshold=0, zero=zero)


class Gathered:
    """What one engine holds gathered, measured against what it holds with nothing gathered,
    taken when this is built: after a first pass, since hpZ's secondary shards are there
    from the first gather on."""

    def __init__(self, engine: zerodp.ZeroEngine) -> None:
        self.engine = engine
        self.checks = 0
        assert self.available() == set(), self.available()
        self.base = self.engine.model_state_bytes().params

    def available(self) -> set[str]:
        model = self.engine.module
        return {
            name
            for name, param in model.named_parameters()
            if self.engine.param_status(param) is not zerodp.zero.ParamStatus.NOT_AVAILABLE
        }

    def check(self, expected: nn.Module | None, where: str) -> None:
        """Exactly `expected`'s parameters (None: nothing) are gathered, and their bytes."""
        model = self.engine.module
        names = {
            n for n, p in model.named_parameters() if expected is not None and _in(p, expected)
        }
        kept = [p for n, p in model.named_parameters() if n in names]
        numel = sum(p.numel() for p in {id(p): p for p in kept}.values())
        itemsize = next(model.parameters()).element_size()
        assert self.available() == names, (where, self.available(), names)
        assert self.engine.params.gatherer.live_numel == numel, (where, numel)
        measured = self.engine.model_state_bytes().params - self.base
        assert measured == numel * itemsize, (where, measured, numel * itemsize)
        self.checks += 1


def _in(param: nn.Parameter, module: nn.Module) -> bool:
    return any(param is p for p in module.parameters())


# -- an inference engine ------------------------------------------------------------------


def inference_engine_case(zero: dict[str, Any]) -> int:
    """no_grad, then grad mode, output alive and dropped; then an input that requires grad."""
    torch.manual_seed(0)
    plain = TinyNet()
    torch.manual_seed(0)
    engine, *_ = zerodp.initialize(model=TinyNet(), config=_config(plain.fc2, None, zero))
    assert engine.mode is zerodp.EngineMode.INFERENCE
    x = tiny_inputs(dist.get_rank(), 0)
    with torch.no_grad():
        out = engine(x)
    gathered = Gathered(engine)  # nothing gathered after a no_grad forward
    del out
    for call in range(2):  # the first records the order: the second has a head to keep
        out = engine(x)
        assert out.grad_fn is None and torch.equal(out, plain(x).detach())
        gathered.check(None, f"grad-mode forward {call}, output alive")
        del out
        gathered.check(None, f"grad-mode forward {call}, output dropped")
    # Through an input that requires grad a backward can come: the head stays for it.
    x_grad = x.clone().requires_grad_(True)
    out = engine(x_grad)
    gathered.check(engine.module.fc2, "an input requiring grad, output alive")
    del out
    gathered.check(None, "an input requiring grad, output dropped")
    out = engine(x_grad)
    out.square().sum().backward()
    gathered.check(None, "after a backward to the input")
    x_plain = x.clone().requires_grad_(True)
    plain(x_plain).square().sum().backward()
    assert x_grad.grad is not None and torch.equal(x_grad.grad, x_plain.grad)
    engine.destroy()
    return gathered.checks


def test_inference_engine_keeps_nothing_gathered(pools) -> None:
    assert pools(2).run(inference_engine_case, {}) == [7, 7]


# -- evaluation and training ------------------------------------------------------------


def _mse(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _warm_up(run: Lockstep, x: torch.Tensor) -> Gathered:
    """A first training step beside the reference (it records the backward's order, so the
    next forwards know its head); then what is gathered is measured from here."""
    out, ref_out = run.forward(x)
    run.backward((_mse(out), _mse(ref_out)))
    run.step()
    return Gathered(run.engine)


def _train_step(run: Lockstep, x: torch.Tensor, gathered: Gathered, head: nn.Module) -> None:
    """A training step beside the reference; the head is kept from the forward to its backward."""
    out, ref_out = run.forward(x)
    gathered.check(head, "training forward")
    run.backward((_mse(out), _mse(ref_out)))
    gathered.check(None, "after the backward")
    run.step()


def evaluation_case(checkpoint: str | None, zero: dict[str, Any]) -> int:
    """Train, evaluate without no_grad (output alive, a loss from it, dropped), train again."""
    torch.manual_seed(0)
    model = LifecycleNet(checkpoint)
    run = Lockstep(model, _config(model.out, ADAM, zero), _reference_adam)
    rank = dist.get_rank()
    gathered = _warm_up(run, lifecycle_inputs(rank, 0))
    _train_step(run, lifecycle_inputs(rank, 1), gathered, model.out)
    run.engine.eval()
    out, _ = run.forward(lifecycle_inputs(rank, 2))
    gathered.check(model.out, "evaluation forward, output alive")
    loss = _mse(out)
    del out
    gathered.check(model.out, "evaluation forward, a loss from its output alive")
    del loss
    gathered.check(None, "evaluation forward, output dropped")
    run.engine.train()
    _train_step(run, lifecycle_inputs(rank, 3), gathered, model.out)
    assert run.grad_comparisons == 3 and run.param_comparisons == 3
    run.close()
    return run.grad_comparisons


def tied_evaluation_case(zero: dict[str, Any]) -> int:
    """Tied input and output embeddings: the head is the tied weight, which goes too."""
    torch.manual_seed(0)
    model = TiedLM()
    run = Lockstep(model, _config(model.embed, ADAM, zero), _reference_adam)
    rank = dist.get_rank()
    gathered = _warm_up(run, token_inputs(rank, 0))
    _train_step(run, token_inputs(rank, 1), gathered, model.embed)
    run.engine.eval()
    out, _ = run.forward(token_inputs(rank, 2))
    gathered.check(model.embed, "evaluation forward, output alive")
    del out
    gathered.check(None, "evaluation forward, output dropped")
    run.engine.train()
    _train_step(run, token_inputs(rank, 3), gathered, model.embed)
    run.close()
    return run.param_comparisons


def awaiting_backward_case(zero: dict[str, Any]) -> int:
    """Forward A kept for its backward; forward B's output dropped; A's backward, exact."""
    torch.manual_seed(0)
    model = LifecycleNet()
    run = Lockstep(model, _config(model.out, ADAM, zero), _reference_adam)
    rank = dist.get_rank()
    gathered = _warm_up(run, lifecycle_inputs(rank, 0))
    out, ref_out = run.forward(lifecycle_inputs(rank, 1))
    gathered.check(model.out, "forward A")
    other = run.engine(lifecycle_inputs(rank, 2))
    del other
    gathered.check(model.out, "forward B dropped: A's backward can still come")
    run.backward((_mse(out), _mse(ref_out)))
    gathered.check(None, "after A's backward")
    run.step()
    run.close()
    return run.param_comparisons


def retained_and_interleaved_case(zero: dict[str, Any]) -> list[int]:
    """retain_graph and a second backward; two forwards then two backwards; a no_grad eval."""
    torch.manual_seed(0)
    model = LifecycleNet()
    run = Lockstep(model, _config(model.out, ADAM, zero), _reference_adam)
    rank = dist.get_rank()
    gathered = _warm_up(run, lifecycle_inputs(rank, 0))
    gatherer = run.engine.params.gatherer
    out, ref_out = run.forward(lifecycle_inputs(rank, 1))
    gathered.check(model.out, "a forward whose backward will retain its graph")
    losses = (_mse(out), _mse(ref_out))
    peaks = []
    for call in range(2):
        gatherer.reset_peak()
        run.backward(losses, retain_graph=True)
        peaks.append(gatherer.peak_live_numel)
        gathered.check(None, f"after backward {call} through the retained graph")
    assert peaks[0] == peaks[1] > 0, peaks
    del out, ref_out, losses
    gathered.check(None, "the retained graph dropped")
    run.step()
    first, ref_first = run.forward(lifecycle_inputs(rank, 2))
    second, ref_second = run.forward(lifecycle_inputs(rank, 3))
    gathered.check(model.out, "two forwards awaiting their backwards")
    run.backward((_mse(second), _mse(ref_second)))
    gathered.check(None, "after the second forward's backward")
    del second, ref_second
    gathered.check(None, "the second forward's graph freed")
    run.backward((_mse(first), _mse(ref_first)))
    gathered.check(None, "after the first forward's backward")
    del first, ref_first
    run.step()
    run.engine.eval()
    with torch.no_grad():
        out = run.engine(lifecycle_inputs(rank, 4))
    gathered.check(None, "a no_grad evaluation forward, output alive")
    del out
    run.engine.train()
    _train_step(run, lifecycle_inputs(rank, 5), gathered, model.out)
    run.close()
    return [run.grad_comparisons, run.param_comparisons, gathered.checks]


def lower_stage_case(stage: int) -> int:
    """Stages 0-2: every parameter stays whole, the same bytes, through evaluation forwards."""
    torch.manual_seed(0)
    model = TinyNet()
    run = Lockstep(model, zerodp_config(stage, optimizer=ADAM), _reference_adam)
    rank = dist.get_rank()
    warm_out, warm_ref = run.forward(tiny_inputs(rank, 0))
    run.backward((_mse(warm_out), _mse(warm_ref)))
    run.step()
    engine = run.engine
    base = engine.model_state_bytes().params
    available = zerodp.zero.ParamStatus.AVAILABLE

    def check(where: str) -> None:
        statuses = {engine.param_status(p) for p in engine.module.parameters()}
        assert statuses == {available}, (stage, where, statuses)
        assert engine.model_state_bytes().params == base, (stage, where)

    engine.eval()
    out = engine(tiny_inputs(rank, 1))
    check("evaluation forward, output alive")
    del out
    check("evaluation forward, output dropped")
    with torch.no_grad():
        out = engine(tiny_inputs(rank, 2))
    check("no_grad evaluation forward, output alive")
    del out
    engine.train()
    out, ref_out = run.forward(tiny_inputs(rank, 3))
    run.backward((_mse(out), _mse(ref_out)))
    check("after a backward")
    run.step()
    run.close()
    return run.param_comparisons


def uneven_drop_case(zero: dict[str, Any]) -> int:
    """Rank 0 drops an evaluation output that the others keep; a full state dict after it."""
    torch.manual_seed(0)
    model = TinyNet()
    run = Lockstep(model, _config(model.fc2, ADAM, zero), _reference_adam)
    rank = dist.get_rank()
    gathered = _warm_up(run, tiny_inputs(rank, 0))
    out, _ = run.forward(tiny_inputs(rank, 1))
    if rank == 0:
        del out
        gathered.check(None, "rank 0 dropped its output")
    else:
        gathered.check(model.fc2, "the other ranks keep theirs")
    state = zerodp.zero.full_state_dict(run.engine.module)
    gathered.check(None, "after a full state dict, on every rank")
    reference = run.ref_model.state_dict()
    assert state.keys() == reference.keys()
    for name, value in state.items():
        torch.testing.assert_close(value, reference[name], **default_tolerance(torch.float32))
    _train_step(run, tiny_inputs(rank, 2), gathered, model.fc2)
    run.close()
    return len(state)


def test_evaluation_forward_releases_when_its_output_goes(pools) -> None:
    pool = pools(2)
    for checkpoint in (None, "reentrant", "non_reentrant"):
        assert pool.run(evaluation_case, checkpoint, {}) == [3, 3], checkpoint
    assert pool.run(tied_evaluation_case, {}) == [3, 3]


def test_training_forward_keeps_its_head_until_the_backward(pools) -> None:
    assert pools(2).run(awaiting_backward_case, {}) == [2, 2]


def test_retained_graphs_and_interleaved_backwards_gather_again_exactly(pools) -> None:
    assert pools(2).run(retained_and_interleaved_case, {}) == [[6, 4, 11]] * 2


def test_stages_0_to_2_keep_every_parameter_whole(pools) -> None:
    pool = pools(2)
    for stage in (0, 1, 2):
        assert pool.run(lower_stage_case, stage) == [2, 2], stage


def test_ranks_dropping_an_output_at_different_points_gather_alike(pools) -> None:
    assert pools(2).run(uneven_drop_case, {}) == [6, 6]
