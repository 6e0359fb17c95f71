"""Which step an optimizer gets: flat shards (elementwise) or whole tensors (tensor-wise).

A flat shard is a contiguous range of a group's elements, so a tensor that
straddles a shard boundary is seen by each rank as a piece. That is right
only for an optimizer whose update of an element reads that element's
gradient and state alone: Adam, SGD, RMSprop and the rest of `_ELEMENTWISE`.
Every other optimizer takes the tensor-wise step, which hands it whole
tensors (see [Note: tensor-wise step]): exact for any optimizer whose update
of a tensor reads that tensor alone (Muon, Adafactor, LAMB, Shampoo-like
preconditioners), whether zerodp knows its class or not.

A class counts as elementwise only when it is exactly one of torch's
elementwise classes or was declared with `declare_elementwise`: a subclass
may change the update (a LAMB built on Adam), so it is not assumed to keep
it elementwise.
"""

from __future__ import annotations

import enum

import torch


class UpdatePath(enum.Enum):
    """How an optimizer's parameters are stepped."""

    ELEMENTWISE = "elementwise"  # the flat owned ranges, as they are
    TENSORWISE = "tensorwise"  # whole tensors, each at its owner rank


_ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
# Stepped whole-tensor by design; listed so that the documentation and tests name them.
KNOWN_TENSORWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Muon,
    torch.optim.Adafactor,
)
_NOT_SUPPORTED = {
    torch.optim.LBFGS: "it re-evaluates the loss through a closure inside step()",
    torch.optim.SparseAdam: "zerodp reduces gradients dense",
}

_declared_elementwise: set[type] = set()


def declare_elementwise(optimizer_class: type[torch.optim.Optimizer]) -> type:
    """Declare that `optimizer_class` updates each element from that element's gradient and
    state only (a Lion, a Sophia without its Hessian estimate, ...): zerodp then steps it on
    flat shards, which costs no communication beyond ZeRO's own. Returns the class, so it
    can decorate one.

    Undeclared optimizers zerodp does not know are stepped on whole tensors, which is
    exact for any update that reads one tensor at a time (docs/optimizers.md).
    """
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            f"declare_elementwise takes a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )
    if optimizer_class in KNOWN_TENSORWISE:
        raise ValueError(
            f"{optimizer_class.__name__} reads whole tensors (it is not elementwise); zerodp "
            "steps it on whole tensors already"
        )
    _declared_elementwise.add(optimizer_class)
    return optimizer_class


def update_path(optimizer_class: type) -> UpdatePath:
    """The step `optimizer_class` gets; raises for the classes zerodp cannot step at all."""
    for refused, why in _NOT_SUPPORTED.items():
        if issubclass(optimizer_class, refused):
            raise TypeError(
                f"zerodp cannot step {optimizer_class.__name__}: {why}; use AdamW, SGD, or "
                "another torch optimizer"
            )
    if optimizer_class in _ELEMENTWISE or optimizer_class in _declared_elementwise:
        return UpdatePath.ELEMENTWISE
    return UpdatePath.TENSORWISE
