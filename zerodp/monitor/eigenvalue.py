"""The top Hessian eigenvalue of model blocks, by power iteration on Hessian-vector products.

For each block (the whole model, or `layer_num` entries of the container
named `layer_name`), the gradient of the loss with respect to the block's
parameters is taken with `create_graph=True`; each iteration differentiates
`grad . v` again (a double backward through the, possibly sharded, model),
averages the Hessian-vector product over ranks (the Hessian of the global
loss is the mean of the ranks' Hessians) and renormalises. Every rank draws
the same starting vector, so every rank follows the same iteration.

`stability` guards the normalisation against a zero vector; the iteration
stops when the relative change of the estimate falls below `tol`.

The work is done at the accumulation boundary, before the optimizer step
(the weights the loss was computed with are still in place), where the other
monitors run: `engine.backward` only hands over the boundary's loss, whose
graph its backward keeps for this purpose (`retain_graph=True`).
"""

from __future__ import annotations

import operator

import torch
from torch import nn

from zerodp.comm import Comm
from zerodp.config import EigenvalueConfig
from zerodp.errors import ConfigError
from zerodp.monitor.events import eigenvalue_event_name
from zerodp.parallel import WORLD, ParallelDims


class EigenvalueMonitor:
    """Estimates each block's top Hessian eigenvalue at the boundaries the config names."""

    def __init__(
        self, config: EigenvalueConfig, module: nn.Module, comm: Comm, dims: ParallelDims
    ) -> None:
        self.config = config
        self.comm = comm  # the world: every rank holds the block's parameters whole
        # A sum over the world is averaged over the data ranks (raises for tensor slices,
        # which the composition table refuses with this monitor before it gets here).
        self.divisor = dims.gradient_divisor(WORLD)
        self.blocks = self._blocks(module, config.layer_name, config.layer_num)
        self.latest: dict[int, float] = {}  # block -> its latest estimate
        self._loss: torch.Tensor | None = None  # the boundary's loss, graph retained

    @staticmethod
    def _blocks(module: nn.Module, layer_name: str, layer_num: int) -> list[nn.Module]:
        if not layer_name:
            return [module]
        try:
            container = operator.attrgetter(layer_name)(module)
        except AttributeError:
            raise ConfigError(
                f"config key 'eigenvalue.layer_name': the model has no attribute "
                f"'{layer_name}'; name the container of the blocks (e.g. 'blocks')"
            ) from None
        count = layer_num or len(container)
        if count > len(container):
            raise ConfigError(
                f"config key 'eigenvalue.layer_num': got {count}, but '{layer_name}' has "
                f"{len(container)} entries"
            )
        return [container[i] for i in range(count)]

    def due(self, global_steps: int, at_boundary: bool) -> bool:
        resolution = self.config.gas_boundary_resolution
        return at_boundary and (global_steps + 1) % resolution == 0

    def keep_loss(self, loss: torch.Tensor) -> None:
        """The boundary's loss: its backward must retain the graph for `run_pending`."""
        self._loss = loss

    def run_pending(self, global_steps: int, global_samples: int) -> list[tuple[str, float, int]]:
        """At the boundary, before the step: estimate from the kept loss; the events to report."""
        loss, self._loss = self._loss, None
        if loss is None:
            return []
        values = [
            self._top_eigenvalue(loss, block, global_steps + i)
            for i, block in enumerate(self.blocks)
        ]
        self.latest = dict(enumerate(values))
        return [(eigenvalue_event_name(b), v, global_samples) for b, v in self.latest.items()]

    def drop_pending(self) -> None:
        """The window was abandoned (`zero_grad()` before the step): forget the kept loss."""
        self._loss = None

    def _top_eigenvalue(self, loss: torch.Tensor, block: nn.Module, seed: int) -> float:
        params = [p for p in block.parameters() if p.requires_grad]
        if not params:
            return 0.0
        grads = torch.autograd.grad(
            loss, params, create_graph=True, retain_graph=True, allow_unused=True
        )
        pairs = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]
        if not pairs:
            return 0.0
        generator = torch.Generator().manual_seed(seed)
        vector = [torch.randn(p.shape, generator=generator).to(p.device, p.dtype) for p, _ in pairs]
        vector = self._normalised(vector)
        estimate = 0.0
        for iteration in range(self.config.max_iter):
            products = torch.autograd.grad(
                [g for _, g in pairs],
                [p for p, _ in pairs],
                grad_outputs=vector,
                retain_graph=True,
                allow_unused=True,
            )
            hv = [
                torch.zeros_like(v) if h is None else h.detach()
                for h, v in zip(products, vector, strict=True)
            ]
            for tensor in hv:
                self.comm.all_reduce(tensor)
                tensor.div_(self.divisor)
            new_estimate = float(sum((h * v).sum() for h, v in zip(hv, vector, strict=True)))
            vector = self._normalised(hv)
            converged = (
                abs(new_estimate - estimate) / (abs(new_estimate) + self.config.stability)
                < self.config.tol
            )
            estimate = new_estimate
            if iteration > 0 and converged:
                break
        return estimate

    def _normalised(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        norm = torch.stack([t.float().square().sum() for t in tensors]).sum().sqrt()
        return [t / (norm + self.config.stability) for t in tensors]
