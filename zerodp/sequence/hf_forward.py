"""The forward of a Hugging Face model under sequence parallelism: split in, loss summed out.

Two hooks on the engine's root module, so that every way of calling the model
(`engine(...)`, `model(...)` as the HF Trainer and TRL do) behaves the same:

- before the forward, a call that computes a loss without a KV cache is split
  (`inputs.split_batch`) and runs SHARDED; any other call runs WHOLE on every
  rank (generation, evaluation without labels). A WHOLE forward that could be
  backpropagated is refused: each rank would compute the whole sequence's
  gradient and the sum over the sequence group would be S times too large.
- after the forward (also when it raises), the previous mode is back; the
  output's `.loss` of a SHARDED forward is replaced by its sum over the
  sequence group (the whole sequence's loss; this rank's gradient: [Note:
  sequence-parallel loss]), unless the caller sums the values itself
  (`SequenceGroup.sums_losses`, the Trainer integration). A SHARDED forward in
  which no attention call went through zerodp's function is an error: the
  model does not look its attention up in transformers' interface, and its
  layers attended within one slice.

See [Note: sequence-parallel forwards].
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from zerodp.errors import UsageError
from zerodp.sequence.input_split import split_batch, wants_split
from zerodp.sequence.loss import sum_over_sequence
from zerodp.sequence.sequence_group import ForwardMode, FullSequence, SequenceGroup


class SequenceForwardHooks:
    """The root module's hooks described above; `remove()` takes them off."""

    def __init__(self, root: nn.Module, group: SequenceGroup) -> None:
        self.group = group
        self._previous: list[tuple[ForwardMode, FullSequence | None]] = []
        self._handles = [
            root.register_forward_pre_hook(self._before, with_kwargs=True),
            root.register_forward_hook(self._after, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        group = self.group
        self._previous.append((group.mode, group.full))
        named = forward_keywords(module, args, kwargs) if args else kwargs
        if not wants_split(named):
            _refuse_whole_with_gradients(module, group)
            group.to_whole()
            return args, kwargs
        split, full = split_batch(named, group)
        group.to_sharded(full)
        return (), split

    def _after(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not self._previous:  # a pre-hook before ours raised: ours never ran
            return None
        group = self.group
        mode, calls = group.mode, group.attention_calls
        group.restore(*self._previous.pop())
        if output is None or mode is not ForwardMode.SHARDED:
            return None
        if calls == 0:
            raise UsageError(
                f"sequence parallelism: {type(module).__name__}'s forward ran no attention "
                "through zerodp's sequence-parallel attention (its attention does not use "
                "transformers' AttentionInterface), so each rank attended within its own slice; "
                "wrap its attention function with zerodp.sequence.sequence_parallel_attention, "
                "or set sequence_parallel_size to 1"
            )
        if not group.sums_losses:
            return None
        return _with_summed_loss(output, group)


def forward_keywords(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Positional arguments bound to the names of the model's forward."""
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    except TypeError as error:
        raise UsageError(
            f"sequence parallelism: cannot read the forward's arguments: {error}"
        ) from None
    named = dict(bound.arguments)
    for name, parameter in inspect.signature(module.forward).parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and name in named:
            named.update(named.pop(name))
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL and named.pop(name, ()):
            raise UsageError(
                "sequence parallelism: pass the forward's inputs by name "
                "(input_ids=..., labels=...)"
            )
    return named


def _refuse_whole_with_gradients(module: nn.Module, group: SequenceGroup) -> None:
    if not torch.is_grad_enabled() or group.mode is not ForwardMode.OUTSIDE:
        return
    if not any(p.requires_grad for p in module.parameters()):
        return
    raise UsageError(
        f"sequence_parallel_size {group.size}: this forward has no labels= (or it uses a KV "
        "cache), so the engine runs the whole sequence on every rank of the sequence group, "
        f"and a backward through it would add the same gradient {group.size} times; pass "
        "labels= (the engine splits the sequence and computes the loss), or run it under "
        "torch.no_grad()"
    )


def _with_summed_loss(output: Any, group: SequenceGroup) -> Any:
    """`output` with its loss summed over the sequence group ([Note: sequence-parallel loss])."""
    if isinstance(output, dict):  # transformers' ModelOutput is a dict
        loss = output.get("loss")
        if isinstance(loss, torch.Tensor):
            output["loss"] = sum_over_sequence(loss, group.comm)
        return output
    first = output[0] if isinstance(output, tuple) and output else None
    if isinstance(first, torch.Tensor) and first.dim() == 0:  # a tuple output's loss comes first
        return (sum_over_sequence(first, group.comm), *output[1:])
    return output
