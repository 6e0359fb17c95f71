"""zerodp's Adam without bias correction against DeepSpeed's update, written out here."""

from __future__ import annotations

import pytest
import torch

from zerodp.optim.tensorwise import UpdatePath, update_path
from zerodp.optim.uncorrected_adam import UncorrectedAdam


def _closed_form(p, grads, lr, betas, eps, decay, decoupled):
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for grad in grads:
        g = grad if decoupled else grad + decay * p
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        update = m / (v.sqrt() + eps)
        if decoupled:
            update = update + decay * p
        p = p - lr * update
    return p, m, v


@pytest.mark.parametrize("decoupled", [True, False])
def test_the_update_is_deepspeed_s_without_the_corrections(decoupled: bool) -> None:
    torch.manual_seed(0)
    start = torch.randn(17, dtype=torch.float64)
    grads = [torch.randn(17, dtype=torch.float64) for _ in range(4)]
    param = torch.nn.Parameter(start.clone())
    settings = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    optimizer = UncorrectedAdam([param], adam_w_mode=decoupled, **settings)
    for g in grads:
        param.grad = g.clone()
        optimizer.step()
    want, m, v = _closed_form(start, grads, 0.05, (0.8, 0.95), 1e-6, 0.1, decoupled)
    torch.testing.assert_close(param.detach(), want, rtol=0, atol=1e-12)
    state = optimizer.state[param]
    torch.testing.assert_close(state["exp_avg"], m, rtol=0, atol=1e-12)
    torch.testing.assert_close(state["exp_avg_sq"], v, rtol=0, atol=1e-12)
    assert int(state["step"]) == 4
    # Unlike torch's Adam, whose first steps are scaled up by 1 / (1 - beta^t).
    corrected = torch.nn.Parameter(start.clone())
    adam = torch.optim.AdamW([corrected], **settings)
    corrected.grad = grads[0].clone()
    adam.step()
    assert not torch.allclose(
        corrected.detach(), _closed_form(start, grads[:1], 0.05, (0.8, 0.95), 1e-6, 0.1, True)[0]
    )


def test_it_steps_flat_shards() -> None:
    assert update_path(UncorrectedAdam) is UpdatePath.ELEMENTWISE
