"""DeepSpeed's `"optimizer": {"type": "Muon"}` as torch's Muon plus Adam(W).

DeepSpeed 0.19.8 decides per parameter, from the layer's shape and name: a
parameter of two or more dimensions whose name contains neither "embed" nor
"lm_head" (any case) is stepped by Muon; everything else (biases, norms,
embeddings, the output head) by the auxiliary Adam. Each of the user's param
groups is split into its Muon half and its Adam half. A half's settings are,
from least to most specific: the config's shared value (`lr`,
`weight_decay`), then `muon_lr` / `adam_lr`, then the group's own value of a
key that half takes (Muon: lr, momentum, weight_decay; Adam: lr, betas, eps,
weight_decay). zerodp keeps the rule and the settings, and builds torch's
classes: `torch.optim.Muon` (Nesterov momentum, 5 Newton-Schulz steps, the
update scaled by sqrt(max(1, rows/cols)) as DeepSpeed scales it) and AdamW
(Adam with `adam_w_mode: false`).

DeepSpeed's shapes are the layer's, not a partition's: under zero.Init zerodp's
parameters keep their shapes, so the rule sees the same matrices. A parameter
of more than two dimensions (a convolution filter) is orthogonalized as a
matrix of its first dimension by the rest, as DeepSpeed treats 4-D filters.
`ns_method` "gram" (DeepSpeed's default) is the same Newton-Schulz polynomial
iterated on the Gram matrix to save work; zerodp runs torch's iteration for
either value (docs/configuration.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zerodp.optim.param_groups import ParamGroupSpec
from zerodp.optim.tensorwise.ownership import matrix_view
from zerodp.optim.torch_optimizers import OptimizerSource

KEYWORDS = ("embed", "lm_head")  # names DeepSpeed keeps on Adam whatever their shape
MUON_KEYS = ("lr", "momentum", "weight_decay")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
MUON_DEFAULT_LR = 0.02
ADAM_DEFAULT_LR = 3e-4


def uses_muon(name: str, param: nn.Parameter) -> bool:
    """DeepSpeed's rule: a matrix (or more dimensions) not named like an embedding or head."""
    return param.dim() >= 2 and not any(word in name.lower() for word in KEYWORDS)


def split_for_muon(
    specs: Sequence[ParamGroupSpec], names: dict[int, str], params: dict[str, Any]
) -> tuple[list[ParamGroupSpec], list[OptimizerSource], dict[str, tuple[int, ...]]]:
    """(specs: each group's Muon half then its Adam half, the two optimizer sources, the
    matrix shapes of parameters of more than two dimensions)."""
    shared_muon = {k: params[k] for k in ("momentum", "weight_decay")}
    shared_muon["lr"] = _first(params["muon_lr"], params["lr"], MUON_DEFAULT_LR)
    shared_adam = {k: params[k] for k in ("betas", "eps", "weight_decay")}
    shared_adam["lr"] = _first(params["adam_lr"], params["lr"], ADAM_DEFAULT_LR)
    out: list[ParamGroupSpec] = []
    muon_groups: list[int] = []
    adam_groups: list[int] = []
    step_shapes: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        muon = [p for p in spec.params if uses_muon(names[id(p)], p)]
        adam = [p for p in spec.params if not uses_muon(names[id(p)], p)]
        for half, keys, indices in ((muon, MUON_KEYS, muon_groups), (adam, ADAM_KEYS, adam_groups)):
            if half:
                indices.append(len(out))
                own = {k: v for k, v in spec.options.items() if k in keys}
                out.append(ParamGroupSpec(params=half, options=own))
        for param in muon:
            if param.dim() > 2:
                step_shapes[names[id(param)]] = matrix_view(tuple(param.shape))
    adam_class = torch.optim.AdamW if params["adam_w_mode"] else torch.optim.Adam
    sources = [
        OptimizerSource(
            groups=muon_groups,
            cls=torch.optim.Muon,
            kwargs={**shared_muon, "nesterov": True, "ns_steps": 5},
        ),
        OptimizerSource(groups=adam_groups, cls=adam_class, kwargs=shared_adam),
    ]
    return out, [s for s in sources if s.groups], step_shapes


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)
