"""zerodp.ops: DeepSpeed's optimizer classes, their arguments, and what those arguments mean.

Adam and Adagrad are compared with torch's own classes (bitwise: the same kernels);
LAMB and Lion with their closed forms written out here in float64 (DeepSpeed's
kernel formulas, term for term).
"""

from __future__ import annotations

import math

import pytest
import torch

from zerodp.errors import UsageError
from zerodp.ops.adagrad import DeepSpeedCPUAdagrad
from zerodp.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zerodp.ops.lamb import FusedLamb
from zerodp.ops.lion import DeepSpeedCPULion, FusedLion
from zerodp.optim.tensorwise.selection import UpdatePath, update_path
from zerodp.optim.uncorrected_adam import UncorrectedAdam

STEPS = 6


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (3,), (4, 4)]
    return [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]


def grads(step: int, like: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator) for p in like]


def run(optimizer_of, seed: int = 0) -> list[torch.Tensor]:
    ps = params(seed)
    optimizer = optimizer_of(ps)
    for step in range(STEPS):
        for p, g in zip(ps, grads(step, ps), strict=True):
            p.grad = g
        optimizer.step()
    return [p.detach().clone() for p in ps]


def assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("decay", [0.0, 0.1])
@pytest.mark.parametrize("decoupled", [True, False])
def test_fused_adam_is_torchs_adam(decoupled: bool, decay: float) -> None:
    torch_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    expected = run(lambda ps: torch_class(ps, lr=0.01, weight_decay=decay, fused=True))
    assert_equal(
        run(lambda ps: FusedAdam(ps, lr=0.01, adam_w_mode=decoupled, weight_decay=decay)), expected
    )
    assert_equal(
        run(lambda ps: DeepSpeedCPUAdam(ps, lr=0.01, adamw_mode=decoupled, weight_decay=decay)),
        expected,
    )


@pytest.mark.parametrize("decoupled", [True, False])
def test_without_bias_correction_each_group_follows_its_own_setting(decoupled: bool) -> None:
    """bias_correction=False is UncorrectedAdam's update; a group may say otherwise."""
    uncorrected = run(
        lambda ps: UncorrectedAdam(ps, lr=0.01, weight_decay=0.1, adam_w_mode=decoupled)
    )
    assert_equal(
        run(
            lambda ps: FusedAdam(
                ps, lr=0.01, weight_decay=0.1, adam_w_mode=decoupled, bias_correction=False
            )
        ),
        uncorrected,
    )
    torch_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    corrected = run(lambda ps: torch_class(ps, lr=0.01, weight_decay=0.1, fused=True))

    def mixed(ps: list[torch.nn.Parameter]) -> FusedAdam:
        groups = [{"params": ps[:2]}, {"params": ps[2:], "bias_correction": True}]
        return FusedAdam(
            groups, lr=0.01, weight_decay=0.1, adam_w_mode=decoupled, bias_correction=False
        )

    result = run(mixed)
    assert_equal(result[:2], uncorrected[:2])
    assert_equal(result[2:], corrected[2:])


def test_cpu_adagrad_is_torchs_adagrad() -> None:
    expected = run(lambda ps: torch.optim.Adagrad(ps, lr=0.05, weight_decay=0.1, eps=1e-10))
    assert_equal(run(lambda ps: DeepSpeedCPUAdagrad(ps, lr=0.05, weight_decay=0.1)), expected)


def lamb_reference(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    decay: float,
    *,
    bias_correction: bool = True,
    eps_inside_sqrt: bool = False,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    seed: int = 0,
) -> list[torch.Tensor]:
    """DeepSpeed FusedLamb's kernel in float64: the moments' step scaled by the bias
    corrections, and a trust ratio ||p|| / ||update|| clamped to [min_coeff, max_coeff]."""
    ps = [p.detach().double() for p in params(seed)]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for step in range(STEPS):
        t = step + 1
        for p, m, v, grad in zip(ps, ms, vs, grads(step, ps), strict=True):
            g = grad.double()
            m.mul_(betas[0]).add_((1 - betas[0]) * g)
            v.mul_(betas[1]).add_((1 - betas[1]) * g * g)
            denom = (v + eps).sqrt() if eps_inside_sqrt else v.sqrt() + eps
            update = m / denom + decay * p
            w, u = p.norm().item(), update.norm().item()
            ratio = min(max(w / u, min_coeff), max_coeff) if w and u else 1.0
            size = (
                lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t) if bias_correction else lr
            )
            p.sub_(size * ratio * update)
    return ps


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"weight_decay": 0.05},
        {"bias_correction": False},
        {"eps_inside_sqrt": True, "eps": 1e-3},
        {"max_coeff": 0.2, "min_coeff": 0.1},  # the clamp decides every step
        {"max_coeff": 1000.0, "min_coeff": 100.0},
    ],
)
def test_fused_lamb_computes_deepspeeds_kernel(options: dict) -> None:
    lr, betas = 0.02, (0.8, 0.95)
    result = run(lambda ps: FusedLamb(ps, lr=lr, betas=betas, **options))
    expected = lamb_reference(
        lr,
        betas,
        options.get("eps", 1e-8),
        options.get("weight_decay", 0.0),
        bias_correction=options.get("bias_correction", True),
        eps_inside_sqrt=options.get("eps_inside_sqrt", False),
        max_coeff=options.get("max_coeff", 10.0),
        min_coeff=options.get("min_coeff", 0.01),
    )
    for got, want in zip(result, expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-6)  # fp32 round-off


def test_lamb_trust_ratio_is_one_for_a_zero_weight() -> None:
    weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = FusedLamb([weight], lr=0.1, min_coeff=0.5)
    weight.grad = torch.ones(4)
    optimizer.step()
    assert optimizer.get_lamb_coeffs() == [1.0]
    # lr * sqrt(1 - b2) / (1 - b1) * m / (sqrt(v) + eps), with m = 0.1 and sqrt(v) = sqrt(0.001)
    expected = -0.1 * math.sqrt(0.001) / 0.1 * (0.1 / (math.sqrt(0.001) + 1e-8))
    torch.testing.assert_close(weight.detach(), torch.full((4,), expected), rtol=1e-6, atol=0)


def lion_reference(lr: float, betas: tuple[float, float], decay: float) -> list[torch.Tensor]:
    ps = [p.detach().double() for p in params()]
    ms = [torch.zeros_like(p) for p in ps]
    for step in range(STEPS):
        for p, m, grad in zip(ps, ms, grads(step, ps), strict=True):
            g = grad.double()
            c = betas[0] * m + (1 - betas[0]) * g
            p.mul_(1 - lr * decay).sub_(lr * torch.sign(c))
            m.mul_(betas[1]).add_((1 - betas[1]) * g)
    return ps


@pytest.mark.parametrize("cls", [FusedLion, DeepSpeedCPULion])
def test_lion_is_the_algorithm(cls: type) -> None:
    result = run(lambda ps: cls(ps, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1))
    for got, want in zip(result, lion_reference(0.01, (0.9, 0.99), 0.1), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)


def test_lion_leaves_an_element_with_no_signal() -> None:
    """sign(0) = 0: an element with zero gradient and momentum only decays."""
    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    optimizer = FusedLion([weight], lr=0.1, weight_decay=0.5)
    weight.grad = torch.tensor([0.0, 1.0])
    optimizer.step()
    assert weight.tolist() == pytest.approx([0.95, 2.0 * 0.95 - 0.1])


def test_elementwise_classes_step_flat_shards_and_lamb_whole_tensors() -> None:
    for cls in (FusedAdam, DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, FusedLion, DeepSpeedCPULion):
        assert update_path(cls) is UpdatePath.ELEMENTWISE, cls
    assert update_path(FusedLamb) is UpdatePath.TENSORWISE


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda ps: FusedAdam(ps, amsgrad=True), "no AMSGrad variant"),
        (lambda ps: DeepSpeedCPUAdam(ps, amsgrad=True), "no AMSGrad variant"),
        (lambda ps: DeepSpeedCPUAdam(ps, fp32_optimizer_states=False), "moments in fp32"),
        (lambda ps: DeepSpeedCPULion(ps, fp32_optimizer_states=False), "momentum in fp32"),
        (lambda ps: DeepSpeedCPUAdagrad(ps, amsgrad=True), "no AMSGrad variant"),
        (lambda ps: FusedLamb(ps, amsgrad=True), "no AMSGrad variant"),
        (lambda ps: FusedLamb(ps, max_grad_norm=1.0), '"gradient_clipping": 1.0'),
        (lambda ps: FusedLamb(ps).step(scale=2.0), "takes the gradients from .grad"),
    ],
)
def test_arguments_zerodp_cannot_honour_are_refused(make, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        make(params())
