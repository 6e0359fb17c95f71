"""A flat group: parameters that live as views of one flat, padded buffer.

Every parameter zerodp manages belongs to exactly one `FlatGroup`. The group's
`full` buffer holds all of its parameters end to end (padded to a multiple of
the world size); each parameter's tensor is a view into it, so one collective
moves the whole group and no copy is made to or from parameter tensors. The
words used here (full, shard, owned range, persistent) are defined in
[Note: zerodp tensors] in `zerodp.group_state`.

- A persistent group keeps its full buffer allocated, and its `shard` is a
  view of it (every group at stages 0-2; small parameters at stage 3).
- A sharded group (stage 3) keeps a separate `shard`; `free_full()` resizes
  the full buffer's storage to zero in place and `alloc_full()` gives it its
  size back, ready to be refilled; parameters keep pointing at the same
  storage throughout. See [Note: stage 3 storage] in `zerodp.group_state.gather`.
"""

from __future__ import annotations

import torch
from torch import nn

from zerodp.errors import ParamStateError
from zerodp.partition.layout import FlatLayout
from zerodp.partition.slicing import Slicing
from zerodp.torch_internals import PlainTensorOps


class FlatGroup:
    """One group's flat buffer, its rank's shard, and which range its optimizer owns."""

    def __init__(
        self,
        *,
        params: list[nn.Parameter],
        names: list[str],
        world_size: int,
        rank: int,
        device: torch.device,
        param_group_index: int,
        persistent: bool,
        owns_full: bool = False,
        slicing: Slicing = Slicing.WHOLE,
    ) -> None:
        if not params:
            raise ValueError("a FlatGroup needs at least one parameter")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of one FlatGroup must share a dtype, got {dtypes}")
        if owns_full and not persistent:
            raise ValueError("a sharded group cannot own its full buffer; use persistent=True")
        self.params = params
        self.names = names
        self.param_group_index = param_group_index
        self.dtype = params[0].dtype
        self.device = device
        self.rank = rank
        self.layout = FlatLayout.build([tuple(p.shape) for p in params], world_size)
        self.persistent = persistent
        self.owns_full = owns_full
        # Whether its parameters are slices (each rank of a tensor or EP group holds other
        # values): the gradient norm sums their squares over that group too, and `world_size`
        # and `rank` are those of the ranks holding the same values (for experts, the
        # expert-data group).
        self.slicing = slicing
        self.world_size = world_size

        self.full = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=device)
        with torch.no_grad():
            for param, slot in zip(params, self.layout.slots, strict=True):
                self.full[slot.offset : slot.end].copy_(param.detach().reshape(-1))
        for param, slot in zip(params, self.layout.slots, strict=True):
            # Once, at set-up: the parameter becomes a view of the flat buffer.
            param.data = self.full[slot.offset : slot.end].view(slot.shape)
        start, end = self.layout.shard_range(rank)
        self.shard = self.full[start:end] if persistent else self.full[start:end].clone()
        self.shard_offloaded = False  # the shard lives on the host or in a file (offload_param)

    @property
    def tensor_split(self) -> bool:
        """Its parameters are tensor-parallel slices."""
        return self.slicing is Slicing.TENSOR

    @property
    def expert(self) -> bool:
        """Its parameters are expert slices, sharded over the expert-data group."""
        return self.slicing is Slicing.EXPERT

    @property
    def trainable(self) -> bool:
        """Whether the group's parameters require grad (its members all agree, see
        `zerodp.stage3.init.adopt_init_groups`)."""
        with PlainTensorOps():  # a metadata read: no stage 3 Python dispatch per parameter
            return all(p.requires_grad for p in self.params)

    # -- sizes and ranges -------------------------------------------------------------

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def padded_numel(self) -> int:
        return self.layout.padded_numel

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.layout.shard_range(self.rank)

    @property
    def owned_range(self) -> tuple[int, int]:
        """The part of the full buffer this rank's optimizer steps (decided here, nowhere else)."""
        return (0, self.padded_numel) if self.owns_full else self.shard_range

    @property
    def owned(self) -> torch.Tensor:
        """The model's values of the owned range: the full buffer, or this rank's shard."""
        return self.full if self.owns_full else self.shard

    def slot_of(self, position: int) -> tuple[int, int]:
        slot = self.layout.slots[position]
        return slot.offset, slot.end

    def position_of(self, param: nn.Parameter) -> int:
        """Where `param` sits in the group (by identity: parameters compare elementwise)."""
        for position, candidate in enumerate(self.params):
            if candidate is param:
                return position
        raise KeyError(f"{param.shape} is not a parameter of {self}")

    def cast_(self, dtype: torch.dtype) -> None:
        """Convert the group to `dtype` (once, at set-up: mixed precision's model copy).

        A new full buffer of `dtype` replaces the old one and the parameters become
        views of it; a separate shard is converted too. A freed full buffer stays
        freed (only the shard holds values then).
        """
        if dtype == self.dtype:
            return
        resident = self.full_is_allocated
        if resident:
            self.full = self.full.to(dtype)
        else:
            self.full = torch.empty(self.layout.padded_numel, dtype=dtype, device=self.device)
        for param, slot in zip(self.params, self.layout.slots, strict=True):
            param.data = self.full[slot.offset : slot.end].view(slot.shape)
        start, end = self.layout.shard_range(self.rank)
        self.shard = self.full[start:end] if self.persistent else self.shard.to(dtype)
        if not resident:
            self.free_full()
        self.dtype = dtype

    def place_shard(self, tensor: torch.Tensor) -> None:
        """Keep a sharded group's shard in `tensor` instead (host memory or a file: offload).

        Gathering then copies it into the full buffer before the all-gather.
        """
        if self.persistent:
            raise ValueError(f"{self} is persistent: its shard is a view of the full buffer")
        if tensor.numel() != self.shard.numel() or tensor.dtype != self.shard.dtype:
            raise ValueError(f"{self}: a shard of {self.shard.numel()} {self.shard.dtype} needed")
        with torch.no_grad():
            tensor.copy_(self.shard)
        self.shard = tensor
        self.shard_offloaded = True

    def take_shard_from_full(self) -> None:
        """Refresh a separate shard from the full buffer (after the full buffer was overwritten)."""
        if not self.persistent:
            start, end = self.shard_range
            self.shard.copy_(self.full[start:end])

    # -- `param.data = t`: a parameter that no longer views the buffer -----------------

    def replaced_params(self) -> list[int]:
        """Positions of parameters whose `.data` was replaced (`param.data = t`).

        Such a parameter shows `t` while the group goes on stepping, gathering
        and saving its buffer: the assignment would be lost, or the parameter
        would never train. Asked only while the full buffer is allocated; one
        data-pointer comparison per parameter.
        """
        base, size = self.full.data_ptr(), self.full.element_size()
        replaced = []
        for position, (param, slot) in enumerate(zip(self.params, self.layout.slots, strict=True)):
            if slot.numel and (
                param.data_ptr() != base + slot.offset * size or param.shape != slot.shape
            ):
                replaced.append(position)
        return replaced

    def drop_replaced(self) -> None:
        """Parameters whose `.data` was replaced view the buffer again; what they held is
        dropped, as any other write to a gathered parameter is when it is released."""
        self.reattach(self.replaced_params())

    def reattach(self, positions: list[int]) -> None:
        """The parameters at `positions` view the buffer again."""
        for position in positions:
            slot = self.layout.slots[position]
            self.params[position].data = self.full[slot.offset : slot.end].view(slot.shape)

    @torch.no_grad()
    def adopt_replaced(self) -> bool:
        """Keep what `param.data = t` wrote: `t`'s values go into the buffer, which the
        parameter views again. True when anything was adopted.

        A `t` of another shape, dtype or device cannot live in the buffer: that raises
        `ParamStateError` before anything changes (dtypes and devices are set by the
        config and `initialize`, not by `model.half()` or `model.to()` afterwards).
        """
        positions = self.replaced_params()
        for position in positions:
            value, slot = self.params[position].data, self.layout.slots[position]
            if (tuple(value.shape), value.dtype, value.device) != (
                slot.shape,
                self.dtype,
                self.full.device,
            ):
                raise ParamStateError(
                    f"parameter {self.names[position]!r}: its `.data` was replaced after "
                    f"zerodp.initialize by a tensor of shape {tuple(value.shape)}, {value.dtype} "
                    f"on {value.device}; zerodp keeps it as {slot.shape}, {self.dtype} on "
                    f"{self.full.device}. Write values in place instead "
                    "(`param.data.copy_(t)`), and choose dtypes with the config's bf16/fp16 "
                    "sections and the device before initialize"
                )
        for position in positions:
            slot = self.layout.slots[position]
            self.full[slot.offset : slot.end].copy_(self.params[position].data.reshape(-1))
        self.reattach(positions)
        return bool(positions)

    # -- the full buffer's storage (stage 3) -----------------------------------------

    @property
    def full_is_allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def free_full(self) -> None:
        """Release the full buffer's memory; parameters keep their (now empty) storage."""
        self.full.untyped_storage().resize_(0)

    def alloc_full(self) -> None:
        """Give the full buffer its size back (contents undefined until refilled)."""
        nbytes = self.layout.padded_numel * self.full.element_size()
        storage = self.full.untyped_storage()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    def __repr__(self) -> str:
        shown = ", ".join(self.names[:3]) + (", ..." if len(self.names) > 3 else "")
        return f"FlatGroup({shown}; {self.numel} elements)"
