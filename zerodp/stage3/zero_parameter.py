"""`ZeroParameter`: a stage 3 parameter that makes sure it is gathered before it is read.

A released parameter's storage is empty (see [Note: stage 3 storage]), and
PyTorch does not check every read against the storage size: reading it would
read freed memory. So stage 3 changes the class of each sharded parameter
(the same object: module attributes, optimizer references and user-held
references stay valid) to this subclass, whose `__torch_function__` runs
before every torch operation that takes the parameter:

- inside a forward (or a backward's recomputation) it gathers the parameter
  on use, so a parent module may use a child's weight, and tied weights work
  wherever they are used;
- outside, it raises an error that names the parameter and the fix
  (`zerodp.zero.GatheredParameters`), instead of crashing the process.

Metadata reads (shape, dtype, grad, hooks, ...) never gather. Operations run
with the subclass disabled, so their results are plain tensors.

An engine's parameter is a `ZeroParameter` while its group is released, and
during a forward while its group is gathered but held by no running module
(kept for reuse, prefetched): such a read is claimed for the module running
it, which installs the saved-tensor hooks ([Note: saving windows] in
`zerodp.stage3.saved_tensors`). Otherwise a gathered parameter has the plain
class (`GatherState.guard_with`), so the many operations of a forward and
backward on gathered parameters take torch's own path instead of this
Python one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from zerodp.group_state import GroupState
from zerodp.stage3.compiled import run_eagerly
from zerodp.torch_internals import PlainTensorOps, is_noop_to

# What to do once an operation has run: gets its result, returns what the caller sees.
AfterUse = Callable[[Any], Any]


class ParamOwner(Protocol):
    """What gathers a sharded parameter: an engine's coordinator, or `zero.Init`."""

    def before_use(self, param: nn.Parameter, func: Callable[..., Any]) -> AfterUse | None:
        """Make `param` readable for `func`; may return what to do once `func` has run."""
        ...

    def assign_data(self, param: nn.Parameter, value: Any) -> None:
        """`param.data = value`: honour it, or raise an error that names what to do."""
        ...

    def group_of(self, param: nn.Parameter) -> GroupState | None: ...

    def hold(self, state: GroupState) -> None: ...

    def unhold(self, state: GroupState) -> None: ...


class _Owned:
    """One entry of `_OWNERS`: the parameter (weakly) and its owner."""

    __slots__ = ("key", "owner", "param")

    def __init__(self, param: nn.Parameter, owner: ParamOwner) -> None:
        self.key = id(param)
        self.param = weakref.ref(param, self._forget)
        self.owner = owner

    def _forget(self, _: object) -> None:
        if _OWNERS.get(self.key) is self:
            del _OWNERS[self.key]


# Sharded parameter -> its owner. Looked up on every torch operation that takes a sharded
# parameter, so it is a plain dict keyed by id() (the fastest lookup there is), each entry
# checked against the parameter itself: a parameter that died without `release` (replaced
# by tying while zero.Init built the model) must not lend its owner to a new tensor that
# happens to get its id. Entries go when a parameter is released or dies.
_OWNERS: dict[int, _Owned] = {}


def _owner_entry(param: nn.Parameter) -> ParamOwner | None:
    entry = _OWNERS.get(id(param))
    if entry is None or entry.param() is not param:
        return None
    return entry.owner


_METADATA_PROPERTIES = frozenset(
    {
        "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn",
        "ndim", "layout", "is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_meta",
        "names", "_version", "output_nr", "_base", "is_nested", "itemsize", "name",
        "_backward_hooks", "_post_accumulate_grad_hooks", "_grad", "_grad_fn", "is_mps",
        "is_xpu", "_cdata", "__dict__", "__class__",
    }
)  # fmt: skip

_METADATA_METHODS: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement,
        torch.Tensor.element_size, torch.Tensor.stride, torch.Tensor.is_contiguous,
        torch.Tensor.storage_offset, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
        torch.Tensor.requires_grad_, torch.Tensor.register_hook,
        torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.__hash__,
        torch.Tensor.untyped_storage, torch.Tensor.get_device, torch.Tensor.__len__,
        torch.Tensor._is_view, torch.Tensor.data_ptr,
        # Compares tensor types only (`module.to()` asks it before assigning `.data`).
        torch._has_compatible_shallow_copy_type,
        # Autograd entry points only route gradients; they never read parameter data.
        torch.autograd.grad, torch.autograd.backward,
        # New tensors shaped like the parameter: its data is never read.
        torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
        torch.randn_like, torch.randint_like, torch.Tensor.new_zeros, torch.Tensor.new_ones,
        torch.Tensor.new_empty, torch.Tensor.new_full,
    }
)  # fmt: skip

# Functions that read only the shape or dtype of their second argument.
_SHAPE_OF_OTHER: frozenset[Callable[..., Any]] = frozenset(
    {torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.expand_as, torch.Tensor.type_as}
)


def _is_metadata(func: Callable[..., Any]) -> bool:
    if func in _METADATA_METHODS:
        return True
    if getattr(func, "__name__", "") in ("__get__", "__set__", "__delete__"):
        descriptor = getattr(func, "__self__", None)
        return getattr(descriptor, "__name__", None) in _METADATA_PROPERTIES
    return False


def _visit_params(obj: Any, found: list[nn.Parameter]) -> None:
    if isinstance(obj, ZeroParameter):
        found.append(obj)
    elif isinstance(obj, ZeroView):
        found.append(obj.zerodp_source)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _visit_params(item, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            _visit_params(item, found)


def _dispatch(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> Any:
    """Run a torch operation on sharded parameters (or views of them), gathered as needed."""
    kwargs = kwargs or {}
    if func is torch.Tensor.to and is_noop_to(args[0], args[1:], kwargs):
        return args[0]  # what torch returns too; nothing is read (`module.to(its device)`)
    if _is_data_setter(func) and isinstance(args[0], ZeroParameter):
        owner = _owner_entry(args[0])
        if owner is not None:
            owner.assign_data(args[0], args[1])
            return None
    after: list[AfterUse] = []
    if not _is_metadata(func):
        found: list[nn.Parameter] = []
        if func in _SHAPE_OF_OTHER:
            _visit_params(args[:1], found)
        else:
            _visit_params(args, found)
            if kwargs:
                _visit_params(kwargs, found)
        for param in found:
            owner = _owner_entry(param)
            if owner is not None:
                finish = owner.before_use(param, func)
                if finish is not None:
                    after.append(finish)
    with PlainTensorOps():
        result = func(*args, **kwargs)
    for finish in after:
        result = finish(result)
    return result


# What a graph being traced by torch.compile calls: a parameter that is still a
# `ZeroParameter` is not gathered (gathered ones have the plain class), so the operation
# runs eagerly, gathering on use, and the graph breaks there (see
# [Note: stage 3 under torch.compile]); a block's graph never gets here.
_traced_dispatch = run_eagerly(_dispatch)


class ZeroParameter(nn.Parameter):
    """A sharded stage 3 parameter (see the module docstring)."""

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if torch.compiler.is_compiling():
            return _traced_dispatch(func, args, kwargs)
        return _dispatch(func, args, kwargs)


class ZeroView(torch.Tensor):
    """A view of a sharded parameter handed out while building under `zero.Init`.

    `weight[0]`, `weight.data`, `weight.t()`: the result shares the
    parameter's storage, which is freed again once the operation is done (see
    [Note: stage 3 storage]). Returned as a plain tensor, writing to it later
    (`init.zeros_(module.weight[padding_idx])`) would write to freed memory;
    as a `ZeroView` every operation on it gathers its parameter first and
    publishes what an in-place operation wrote, exactly as an operation on
    the parameter itself does.
    """

    zerodp_source: nn.Parameter

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return _dispatch(func, args, kwargs)


def as_view_of(tensor: torch.Tensor, source: nn.Parameter) -> torch.Tensor:
    """`tensor` (sharing `source`'s storage) as a ZeroView that gathers `source` on use."""
    if isinstance(tensor, (ZeroParameter, ZeroView)):
        return tensor
    view = tensor.as_subclass(ZeroView)
    view.zerodp_source = source
    return view


def _is_data_setter(func: Callable[..., Any]) -> bool:
    return getattr(func, "__name__", "") == "__set__" and is_data_property(func)


def owner_of(param: nn.Parameter) -> ParamOwner | None:
    return _owner_entry(param)


def is_data_property(func: Callable[..., Any]) -> bool:
    """`param.data` (get or set): an alias that escapes the gather-on-use check."""
    descriptor = getattr(func, "__self__", None)
    return getattr(descriptor, "__name__", None) == "data"


def is_in_place(func: Callable[..., Any], kwargs: dict[str, Any] | None = None) -> bool:
    """Whether `func` writes into its first argument (by PyTorch's naming conventions)."""
    name = getattr(func, "__name__", "")
    if name in ("__setitem__", "__set__", "copy_", "set_") or (kwargs and "out" in kwargs):
        return True
    return name.endswith("_") and not name.endswith("__")


def adopt(param: nn.Parameter, owner: ParamOwner) -> None:
    """Make `param` a ZeroParameter gathered through `owner`."""
    if type(param) is not nn.Parameter and not isinstance(param, ZeroParameter):
        raise TypeError(
            f"ZeRO stage 3 cannot shard a parameter of class {type(param).__name__}; "
            "only plain torch.nn.Parameter objects are supported"
        )
    param.__class__ = ZeroParameter
    _OWNERS[id(param)] = _Owned(param, owner)


def release(param: nn.Parameter) -> None:
    """Give `param` its plain class back (the engine is being destroyed)."""
    _OWNERS.pop(id(param), None)
    if isinstance(param, ZeroParameter):
        param.__class__ = nn.Parameter  # type: ignore[assignment]
