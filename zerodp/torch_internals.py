"""The private or undocumented PyTorch surface zerodp uses outside autograd, in one place.

`zerodp.backward.autograd_api` does the same for autograd's internals. Each
function says why the public API does not suffice, so that a torch upgrade
that breaks one of them is a change to this file only. The DCP-specific
internals (ShardedTensor's constructor) live in `zerodp.checkpoint_io.sharded`,
the one other wrapper, because only checkpoint code may import
`torch.distributed`.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

# Runs torch functions with `__torch_function__` subclass dispatch off, so that an operation
# on a `ZeroParameter` returns plain tensors. The documented way to write a subclass's
# `__torch_function__`; only reachable under `torch._C`.
PlainTensorOps = torch._C.DisableTorchFunctionSubclass


def storage_key(tensor: torch.Tensor) -> int:
    """Identifies a tensor's storage across frees and refills (`resize_(0)` and back).

    `data_ptr()` changes when a freed storage is allocated again, and views of
    one storage are different tensor objects; the storage object's C address
    stays the same for as long as any tensor refers to it.
    """
    return int(tensor.untyped_storage()._cdata)


def same_tensor_view(param: torch.Tensor, value: object) -> bool:
    """Whether `value` is `param`'s own data (same storage, shape, strides and offset)."""
    return value is param or (
        isinstance(value, torch.Tensor)
        and storage_key(value) == storage_key(param)
        and value.shape == param.shape
        and value.stride() == param.stride()
        and value.storage_offset() == param.storage_offset()
        and value.dtype == param.dtype
    )


def direct_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters registered on `module` itself, not on its children.

    `module.parameters(recurse=False)` removes duplicates across the whole
    call; a module registering one parameter under two names must list it
    once, which `_parameters` gives directly.
    """
    return [p for p in module._parameters.values() if p is not None]


def direct_parameter_items(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) registered on `module` itself, in registration order."""
    for name, param in module._parameters.items():
        if param is not None:
            yield name, param


def replace_buffers(module: nn.Module, convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace every buffer of `module` and its children with `convert(buffer)`.

    `module.to()` would also move the parameters, which zerodp has laid out
    in flat buffers already; assigning a buffer attribute re-registers it
    correctly, but only `_buffers` lists non-persistent buffers too.
    """
    for owner in module.modules():
        for name, buffer in owner._buffers.items():
            if buffer is not None:
                owner._buffers[name] = convert(buffer)


def init_optimizer_hook_dicts(optimizer: torch.optim.Optimizer) -> None:
    """Give an Optimizer subclass that skips `Optimizer.__init__` the hook registries it needs.

    zerodp's optimizer shares its parameter groups and state with the torch
    optimizer it wraps, so it cannot call `Optimizer.__init__` (which would
    take parameters of its own); `step()`'s hook machinery and
    `state_dict()` still look these dictionaries up.
    """
    optimizer._optimizer_step_pre_hooks = OrderedDict()
    optimizer._optimizer_step_post_hooks = OrderedDict()
    optimizer._optimizer_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_state_dict_post_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_post_hooks = OrderedDict()


def is_noop_to(tensor: torch.Tensor, args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    """Whether `tensor.to(*args, **kwargs)` returns `tensor` itself (same device and dtype).

    Parsed with torch's own argument parser for `Tensor.to` (every spelling:
    a device, a dtype, another tensor, keywords), which is not public.
    """
    if kwargs.get("copy"):
        return False
    try:
        parsed = torch._C._nn._parse_to(*args, **kwargs)  # type: ignore[call-overload]
        device, dtype, _non_blocking, memory_format = parsed
    except (TypeError, RuntimeError):
        return False
    same_device = device is None or torch.device(device) == tensor.device
    same_dtype = dtype is None or dtype == tensor.dtype
    keeps_format = memory_format is None or memory_format is torch.preserve_format
    return same_device and same_dtype and keeps_format


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell torch's LR schedulers that `optimizer` stepped (they warn if it seems it did not).

    A scheduler wraps `optimizer.step` to notice a step; zerodp's engine steps through
    `ZeroOptimizer.apply_step` (the step gate has checked already), which the wrapper
    does not see, so the flag the wrapper would set is set here.
    """
    optimizer._opt_called = True  # type: ignore[attr-defined]


def forward_raised() -> BaseException | None:
    """Inside a forward hook registered with `always_call=True`: the exception the module's
    forward raised, or None when the forward returned.

    torch calls such a hook from `Module._call_impl`'s `except` block when the forward
    raised, and gives it no sign of that. The exception being handled there has that
    `_call_impl` frame first in its traceback; an exception the caller happens to be
    handling around a successful forward (a retry inside `except`) does not.
    """
    error = sys.exc_info()[1]
    if error is None or error.__traceback__ is None:
        return None
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _CALL_IMPL:
        frame = frame.f_back  # type: ignore[assignment]
    return error if frame is not None and error.__traceback__.tb_frame is frame else None


_CALL_IMPL = nn.Module._call_impl.__code__


class DetachedHooks:
    """Hooks taken out of their modules' hook dicts for a while, then put back where they were.

    `RemovableHandle.remove()` is for good: registering the hook again would put it
    last, after hooks the user registered since, and change their order. Here each
    hook's entry is popped from the dict its handle points to (`hooks_dict_ref`,
    `id`: not public) and re-inserted at its old place by `restore()`; hooks added
    or removed meanwhile keep their own places. A module left with no hook at all
    takes `nn.Module.__call__`'s fast path while they are out.
    """

    def __init__(self, handles: list[RemovableHandle]) -> None:
        # Per dict: (the dict, its keys' order before, the entries taken out).
        self._taken: list[tuple[dict[int, object], list[int], dict[int, object]]] = []
        by_dict: dict[int, tuple[dict[int, object], list[RemovableHandle]]] = {}
        for handle in handles:
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks:
                by_dict.setdefault(id(hooks), (hooks, []))[1].append(handle)
        for hooks, owned in by_dict.values():
            order = list(hooks)
            self._taken.append((hooks, order, {h.id: hooks.pop(h.id) for h in owned}))

    def restore(self) -> None:
        for hooks, order, taken in self._taken:
            current = dict(hooks)
            hooks.clear()
            for key in order:
                if key in taken:
                    hooks[key] = taken[key]
                elif key in current:
                    hooks[key] = current.pop(key)
            hooks.update(current)  # registered while they were out: after the rest, as before
        self._taken = []
