"""The backward-lifecycle conformance matrix: stage x call style x pattern, every gradient checked.

Each cell runs one autograd pattern on zerodp and on the data-parallel reference in lockstep
(a plain model copy per rank; each backward's gradients averaged with an explicit all_reduce)
and compares every full gradient after every backward, and after every optimizer step the
weights (fp32) or the fp32 masters and the bf16/fp16 weights (mixed precision: gradients and
weights bitwise where both sides do the same operations, see `same_arithmetic`); the driver is
`tests.lockstep.Lockstep`, and every case asserts how many comparisons it made
(`COMPARISONS`). Under mixed precision at stages 0 and 1 with accumulation the reference only
sums locally between boundaries, so there zerodp's full gradient is compared with the
reference's local sums averaged by an explicit all_reduce. DDP is not a reference here: it
does not reduce a second backward on a retained graph (PyTorch issue 47260);
`test_ddp_misses_*` shows it. Stage 3 runs with every parameter sharded (persistence
threshold 0).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.configs import optimizer_config, zerodp_config
from tests.lockstep import STYLES, Lockstep
from tests.models import LifecycleNet, TinyNet, lifecycle_inputs, tiny_inputs
from zerodp.testing import ReferenceDP
from zerodp.testing.parity import BITWISE

# torch.optim.Adam's update with the reference's kernel (for-loop): mixed precision is compared
# bitwise, and the default fused kernel is not the recipe under test (test_mixed_precision).
ADAM = optimizer_config("Adam", lr=1e-2, adam_w_mode=False, fused=False)


def _reference_adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def same_arithmetic(dtype: str, style: str) -> bool:
    """Whether zerodp and the hand-written mixed-precision recipe do exactly the same
    operations, so that gradients, fp32 masters and bf16/fp16 weights are compared bitwise:
    the default mixed tolerance (1.6% for bf16) would let a 1% learning-rate or gradient
    error through, and Adam's first step hardly depends on the gradient's scale. The one
    exception (`zerodp.testing.parity.MIXED_TOLERANCE`): a plain fp16 loss.backward(), whose
    loss scale zerodp applies to the gradients, not to the loss. fp32 runs keep the fp32
    tolerance (zerodp sums locally then averages where the reference averages each backward)."""
    return dtype == "bf16" or (dtype == "fp16" and style != "loss_backward")


class LifecycleRun(Lockstep):
    """The lockstep driver on `LifecycleNet`, also counting the engine's backward tasks."""

    def __init__(
        self,
        stage: int,
        style: str,
        gas: int = 1,
        checkpoint: str | None = None,
        dtype: str = "fp32",
    ):
        torch.manual_seed(0)
        config = zerodp_config(
            stage,
            gas=gas,
            optimizer=ADAM,
            persistence_threshold=0,
            dtype=dtype,
            loss_scale_power=4 if dtype == "fp16" else None,
        )
        exact = BITWISE if same_arithmetic(dtype, style) else None
        super().__init__(
            LifecycleNet(checkpoint),
            config,
            _reference_adam,
            style=style,
            grad_tolerance=exact,
            param_tolerance=exact,
        )
        self.prologues: list[int] = []
        self.epilogues: list[int] = []
        self.engine.register_backward_hooks(
            prologue=lambda task: self.prologues.append(task.task_id),
            epilogue=lambda task: self.epilogues.append(task.task_id),
        )
        self.graph_tasks = 0  # what the pattern started, counted by the test itself

    def backward(self, losses: tuple[torch.Tensor, torch.Tensor], retain_graph: bool = False):
        super().backward(losses, retain_graph=retain_graph)
        self.graph_tasks += 1

    def check_task_counts(self) -> None:
        assert len(self.prologues) == self.graph_tasks, (self.prologues, self.graph_tasks)
        assert len(self.epilogues) == self.graph_tasks, (self.epilogues, self.graph_tasks)
        assert len(set(self.prologues)) == self.graph_tasks, "one prologue per graph task"

    def finish(self) -> None:
        self.check_task_counts()
        self.check_all_released()
        self.close()


def _losses(outs: tuple[torch.Tensor, torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]):
    return fn(outs[0]), fn(outs[1])


def mse(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def l1(out: torch.Tensor) -> torch.Tensor:
    return out.abs().mean()


def cubed(out: torch.Tensor) -> torch.Tensor:
    return out.pow(3).mean()


# -- the patterns ------------------------------------------------------------------------------


def case_retain_zero_grad(run: LifecycleRun) -> None:
    """1 (and 4, 5): forward; zero_grad; backward(loss1, retain); zero_grad; backward(loss2)."""
    outs = run.forward(lifecycle_inputs(run.rank, 0))
    run.zero_grad()
    gatherer = run.engine.params.gatherer if run.stage == 3 else None
    if gatherer is not None:
        gatherer.reset_peak()
    run.backward(_losses(outs, mse), retain_graph=True)
    if gatherer is not None:
        first_peak = gatherer.peak_live_numel
        run.check_all_released()  # nothing stays gathered across the retained window
        gatherer.reset_peak()
    run.zero_grad()
    run.backward(_losses(outs, l1))
    if gatherer is not None:
        second_peak = gatherer.peak_live_numel
        assert 0 < second_peak <= first_peak, (second_peak, first_peak)
    assert run.graph_tasks == 2


def case_retain_accumulate(run: LifecycleRun) -> None:
    """2: the same without the second zero_grad: gradients add up."""
    outs = run.forward(lifecycle_inputs(run.rank, 0))
    run.zero_grad()
    run.backward(_losses(outs, mse), retain_graph=True)
    run.backward(_losses(outs, l1))


def case_three_losses(run: LifecycleRun) -> None:
    """3: three losses from one forward, three backward passes."""
    outs = run.forward(lifecycle_inputs(run.rank, 0))
    run.backward(_losses(outs, mse), retain_graph=True)
    run.backward(_losses(outs, l1), retain_graph=True)
    run.backward(_losses(outs, cubed))


def case_gradient_penalty(run: LifecycleRun) -> None:
    """6: autograd.grad(create_graph=True) for a gradient penalty, then backward through it."""
    x = lifecycle_inputs(run.rank, 0).to(run.torch_dtype).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    losses = []
    for model_call, inputs in ((run.engine, x), (run.ref_model, x_ref)):
        loss = mse(model_call(inputs).float())
        (grad_x,) = torch.autograd.grad(loss, inputs, create_graph=True)
        losses.append(loss + grad_x.square().sum())
    run.graph_tasks += 1  # the autograd.grad task (zerodp's; the reference's is not counted)
    run.check("after autograd.grad (nothing reduced)")
    run.backward((losses[0], losses[1]))


def case_checkpoint(run: LifecycleRun) -> None:
    """7: activation checkpointing around the middle block (reentrant or not), two steps."""
    for step in range(2):
        outs = run.forward(lifecycle_inputs(run.rank, step))
        run.backward(_losses(outs, mse))
        run.step()


def case_two_forwards(run: LifecycleRun) -> None:
    """8: two forwards, the sum of both losses, one backward."""
    a = run.forward(lifecycle_inputs(run.rank, 0))
    b = run.forward(lifecycle_inputs(run.rank, 1))
    run.backward((mse(a[0]) + l1(b[0]), mse(a[1]) + l1(b[1])))


def case_frozen_and_unused(run: LifecycleRun) -> None:
    """9: a frozen parameter and one unused in this forward (then used in the next)."""
    outs = run.forward(lifecycle_inputs(run.rank, 0))
    run.backward(_losses(outs, mse))
    run.step()
    outs = run.forward(lifecycle_inputs(run.rank, 1), use_unused=True)
    run.backward(_losses(outs, mse))
    run.step()


def case_accumulation_with_retain(run: LifecycleRun) -> None:
    """10: accumulation over 4 micro-batches; one of them runs two backward passes."""
    for micro in range(4):
        outs = run.forward(lifecycle_inputs(run.rank, micro))
        if micro == 1:
            run.backward(_losses(outs, mse), retain_graph=True)
            run.backward(_losses(outs, l1))
        else:
            run.backward(_losses(outs, mse))
        run.step()


def case_five_steps(run: LifecycleRun) -> None:
    """11: five full steps of pattern 1 with Adam; weights compared after each step."""
    for step in range(5):
        outs = run.forward(lifecycle_inputs(run.rank, step))
        run.zero_grad()
        run.backward(_losses(outs, mse), retain_graph=True)
        run.zero_grad()
        run.backward(_losses(outs, l1))
        run.step()


def case_grad_of_parameters(run: LifecycleRun) -> None:
    """12: autograd.grad(loss, params) returns this rank's local gradients, as with DDP."""
    outs = run.forward(lifecycle_inputs(run.rank, 0))
    params = [p for p in run.model.parameters() if p.requires_grad]
    ref_params = [p for p in run.ref_model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(mse(outs[0]), params, allow_unused=True)
    ref_grads = torch.autograd.grad(mse(outs[1]), ref_params, allow_unused=True)
    run.graph_tasks += 1
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        if ref_grad is None:
            assert grad is None
        else:
            torch.testing.assert_close(grad, ref_grad)
    run.check("kept gradients untouched by autograd.grad")


CASES: dict[str, tuple[Callable[[LifecycleRun], None], dict[str, Any]]] = {
    "01_retain_zero_grad": (case_retain_zero_grad, {}),
    "02_retain_accumulate": (case_retain_accumulate, {}),
    "03_three_losses": (case_three_losses, {}),
    "06_gradient_penalty": (case_gradient_penalty, {}),
    "07_checkpoint_nonreentrant": (case_checkpoint, {"checkpoint": "nonreentrant"}),
    "07_checkpoint_reentrant": (case_checkpoint, {"checkpoint": "reentrant"}),
    "08_two_forwards": (case_two_forwards, {}),
    "09_frozen_and_unused": (case_frozen_and_unused, {}),
    "10_accumulation_with_retain": (case_accumulation_with_retain, {"gas": 4}),
    "11_five_steps": (case_five_steps, {}),
    "12_grad_of_parameters": (case_grad_of_parameters, {}),
}


# The comparisons each case makes, counted by the pattern's own text: (gradient comparisons,
# weight comparisons), one gradient comparison per backward pass (and per explicit
# `run.check`), one weight comparison per optimizer step (accumulation boundary).
COMPARISONS = {
    "01_retain_zero_grad": (2, 0),
    "02_retain_accumulate": (2, 0),
    "03_three_losses": (3, 0),
    "06_gradient_penalty": (2, 0),
    "07_checkpoint_nonreentrant": (2, 2),
    "07_checkpoint_reentrant": (2, 2),
    "08_two_forwards": (1, 0),
    "09_frozen_and_unused": (2, 2),
    "10_accumulation_with_retain": (5, 1),
    "11_five_steps": (10, 5),
    "12_grad_of_parameters": (1, 0),
}


def run_case(
    stage: int, style: str, case: str, gas: int | None = None, dtype: str = "fp32"
) -> tuple[int, int]:
    """Run one case; returns the (gradient, weight) comparisons actually made."""
    pattern, options = CASES[case]
    options = dict(options, dtype=dtype)
    if gas is not None:
        options["gas"] = gas
    run = LifecycleRun(stage, style, **options)
    pattern(run)
    run.finish()  # 4: one prologue and one epilogue per graph task; nothing left gathered
    return run.grad_comparisons, run.param_comparisons


def assert_all_compared(case: str, counts: list[tuple[int, int]]) -> None:
    """Every rank made every comparison the case's pattern calls for (none skipped)."""
    assert all(tuple(c) == COMPARISONS[case] for c in counts), (case, counts)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lifecycle_matrix(pools, stage: int, style: str, case: str) -> None:
    counts = pools(2).run(run_case, stage, style, case)
    assert counts[0][0] > 0
    assert_all_compared(case, counts)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("style", STYLES)
def test_lifecycle_matrix_stage3_world_size_3(pools, style: str, case: str) -> None:
    assert_all_compared(case, pools(3).run(run_case, 3, style, case))


MIXED_CASES = [
    "01_retain_zero_grad",
    "02_retain_accumulate",
    "03_three_losses",
    "06_gradient_penalty",
    "07_checkpoint_reentrant",
    "10_accumulation_with_retain",
    "11_five_steps",
]


@pytest.mark.parametrize("case", MIXED_CASES)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lifecycle_matrix_mixed_precision(pools, stage: int, dtype: str, style: str, case: str):
    assert_all_compared(case, pools(2).run(run_case, stage, style, case, None, dtype))


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_seed_case_under_accumulation(pools, stage: int, gas: int) -> None:
    counts = pools(2).run(run_case, stage, "engine_backward", "01_retain_zero_grad", gas)
    assert_all_compared("01_retain_zero_grad", counts)


# -- DDP, the second witness, is wrong on the seed case ---------------------------------------


def ddp_second_backward_error() -> float:
    torch.manual_seed(0)
    model = TinyNet()
    ddp = DistributedDataParallel(copy.deepcopy(model))
    reference = ReferenceDP(model)
    x = tiny_inputs(dist.get_rank(), 0)
    out = ddp(x)
    mse(out).backward(retain_graph=True)
    ddp.zero_grad()
    l1(out).backward()
    ref_out = model(x)
    reference.run_backward(lambda: mse(ref_out).backward(retain_graph=True))
    reference.zero_grad()
    reference.run_backward(lambda: l1(ref_out).backward())
    return max(
        (p.grad - reference.grad(r)).abs().max().item()
        for p, r in zip(ddp.module.parameters(), model.parameters(), strict=True)
        if r.requires_grad and p.grad is not None
    )


def test_ddp_misses_the_second_backward_on_a_retained_graph(pools) -> None:
    """PyTorch issue 47260: DDP's second backward stays local; zerodp's matrix above does not."""
    errors = pools(2).run(ddp_second_backward_error)
    assert min(errors) > 1e-3, errors
