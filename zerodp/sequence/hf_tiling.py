"""Tiled compute switched on in a Hugging Face causal LM (`"tiled_compute"` in the config).

What is tiled ([Note: tiled compute] in `tiling`):

- `mlp`: each decoder layer's `mlp` whose parameters all sit in `nn.Linear` modules
  (Llama, Mistral, Qwen, Gemma and their LoRA-wrapped forms); a mixture-of-experts block
  is left whole (its router's statistics are per call, not per token). Its forward
  runs on `tile_tokens` tokens at a time, in every forward.
- `logits_loss`: in a forward that computes a causal LM loss with autograd on (labels
  or shift_labels, no KV cache), the output layer computes the loss itself, a tile of
  logits at a time, and the model runs without labels. The returned `.loss` is the
  model's loss; `.logits` is None (they were never built whole). A forward under
  `torch.no_grad()` (evaluation) is not tiled and returns its logits, nor is one
  that TRL's trainers run with `fused_lm_head=True` (TRL then computes the loss from
  chunks of the logits itself).

`tile_tokens` 0 picks the model's hidden size: a tile's widest activation (an MLP's
intermediate, the logits) is then the size of one of the module's weight matrices.

Both work with sequence parallelism or without it: under it, the forward hooks here
run after the split (`hf_forward`), on each rank's slice, and the loss they produce
is what the sequence post-hook sums over the group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerodp.errors import UsageError
from zerodp.sequence.hf_attention import hf_model_in
from zerodp.sequence.hf_forward import forward_keywords
from zerodp.sequence.input_split import wants_split
from zerodp.sequence.loss import count_targets, shift_labels
from zerodp.sequence.tiling import Quiet, tiled_logits_loss, tiled_tokenwise
from zerodp.torch_internals import DetachedHooks

_NOT_TOKENWISE = ("moe", "expert", "router")


@dataclass(frozen=True)
class TilingSettings:
    mlp: bool
    logits_loss: bool
    tile_tokens: int  # 0: the model's hidden size


class _Swapped:
    """A module's `forward` replaced by an instance attribute, and put back as it was."""

    def __init__(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        self.module = module
        self._own = module.__dict__.get("forward")
        self.original: Callable[..., Any] = module.forward
        module.forward = forward

    def restore(self) -> None:
        if self._own is None:
            del self.module.forward
        else:
            self.module.forward = self._own


def _quiet_inside(module: nn.Module, engine_hooks: list[RemovableHandle]) -> Quiet:
    """The context that takes the engine's hooks of the modules inside `module` out."""
    inner = {
        id(hooks)
        for m in module.modules()
        if m is not module
        for hooks in (m._forward_pre_hooks, m._forward_hooks)
    }
    mine = [h for h in engine_hooks if id(h.hooks_dict_ref()) in inner]
    if not mine:
        return contextlib.nullcontext

    @contextlib.contextmanager
    def quiet() -> Iterator[None]:
        detached = DetachedHooks(mine)
        try:
            yield
        finally:
            detached.restore()

    return quiet


def _tokenwise_mlp(module: nn.Module) -> bool:
    for inner in module.modules():
        name = type(inner).__name__.lower()
        if any(word in name for word in _NOT_TOKENWISE):
            return False
        owns = any(True for _ in inner.parameters(recurse=False))
        if owns and not isinstance(inner, nn.Linear):
            return False
    return any(True for _ in module.parameters())


def tiled_mlps(model: nn.Module) -> list[nn.Module]:
    """The decoder layers' `mlp` modules that act on each token alone (see the module doc)."""
    found = []
    for parent in model.modules():
        mlp = parent._modules.get("mlp")
        if isinstance(mlp, nn.Module) and _tokenwise_mlp(mlp) and mlp not in found:
            found.append(mlp)
    return found


def _text_config(hf: nn.Module) -> Any:
    config: Any = getattr(hf, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _hidden_size(hf: nn.Module) -> int:
    text = _text_config(hf)
    size = getattr(text, "hidden_size", None)
    if not isinstance(size, int) or size <= 0:
        raise UsageError(
            f"tiled_compute.tile_tokens 0 uses the model's hidden size, and "
            f"{type(hf).__name__}'s config has none; set tiled_compute.tile_tokens"
        )
    return size


@dataclass
class _PendingLoss:
    targets: torch.Tensor
    count: torch.Tensor
    loss: torch.Tensor | None = None


class TiledCompute:
    """The switches of the module doc on one model; `remove()` undoes them."""

    def __init__(
        self, model: nn.Module, settings: TilingSettings, engine_hooks: list[RemovableHandle]
    ) -> None:
        hf = hf_model_in(model)
        if hf is None:
            raise UsageError(
                f"tiled_compute is on, and {type(model).__name__} is not a Hugging Face model "
                "(transformers' PreTrainedModel): zerodp tiles a transformers causal LM's MLPs and "
                "loss; for another model call zerodp.sequence.tiled_tokenwise / "
                "tiled_logits_loss in its forward, or set tiled_compute.mlp and "
                "tiled_compute.logits_loss to false"
            )
        self.tile = settings.tile_tokens or _hidden_size(hf)
        self._swapped: list[_Swapped] = []
        self._handles: list[RemovableHandle] = []
        self._pending: list[_PendingLoss | None] = []  # per running forward: None, untiled
        if settings.mlp:
            mlps = tiled_mlps(hf)
            if not mlps:
                raise UsageError(
                    f"tiled_compute.mlp is on, and {type(hf).__name__} has no decoder-layer `mlp` "
                    "whose parameters are all in nn.Linear modules (a mixture-of-experts block "
                    "is not tiled); set tiled_compute.mlp to false"
                )
            for mlp in mlps:
                self._tile_mlp(mlp, _quiet_inside(mlp, engine_hooks))
        if settings.logits_loss:
            self._head = self._output_layer(hf)
            self._head_quiet = _quiet_inside(self._head, engine_hooks)
            self._handles += [
                model.register_forward_pre_hook(self._before, with_kwargs=True),
                model.register_forward_hook(self._after, prepend=True, always_call=True),
            ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for swapped in reversed(self._swapped):
            swapped.restore()
        self._handles, self._swapped = [], []

    # -- the MLPs ----------------------------------------------------------------------

    def _tile_mlp(self, mlp: nn.Module, quiet: Quiet) -> None:
        tile = self.tile
        swapped: _Swapped

        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 2:
                return swapped.original(x, *args, **kwargs)
            params: list[torch.Tensor] = [p for p in mlp.parameters() if p.requires_grad]
            return tiled_tokenwise(swapped.original, x, params, tile, quiet)

        swapped = _Swapped(mlp, forward)
        self._swapped.append(swapped)

    # -- the logits and the loss ---------------------------------------------------------

    @staticmethod
    def _output_layer(hf: nn.Module) -> nn.Module:
        output_embeddings: Any = getattr(hf, "get_output_embeddings", None)
        head = output_embeddings() if callable(output_embeddings) else None
        loss = getattr(hf, "loss_function", None)
        text = _text_config(hf)
        problems = []
        if not isinstance(head, nn.Linear):
            problems.append("its output embeddings are not an nn.Linear")
        if getattr(loss, "__name__", "") != "ForCausalLMLoss":
            problems.append("its loss is not transformers' causal LM loss")
        if getattr(text, "final_logit_softcapping", None) is not None:
            problems.append("it soft-caps its logits (final_logit_softcapping)")
        if problems:
            raise UsageError(
                f"tiled_compute.logits_loss is on, and {type(hf).__name__}: "
                + "; ".join(problems)
                + ": zerodp tiles only the plain causal LM loss of a linear output layer; set "
                "tiled_compute.logits_loss to false"
            )
        return cast(nn.Linear, head)

    def _before(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self._pending.append(None)
        if not torch.is_grad_enabled():
            return None
        named = forward_keywords(module, args, kwargs) if args else dict(kwargs)
        keep = named.get("logits_to_keep")
        if not wants_split(named) or not (keep is None or (isinstance(keep, int) and keep == 0)):
            return None
        if named.get("fused_lm_head"):  # TRL computes this loss in chunks itself
            return None
        targets = named.pop("shift_labels", None)
        if targets is None:
            targets = shift_labels(named["labels"])
        count = named.pop("num_items_in_batch", None)
        if count is None:
            count = count_targets(targets)
        named["labels"] = None
        pending = _PendingLoss(targets, torch.as_tensor(count, device=targets.device))
        self._pending[-1] = pending
        head = self._head
        swapped: _Swapped

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            if tuple(hidden.shape[:2]) != tuple(pending.targets.shape):
                raise UsageError(
                    f"tiled_compute.logits_loss: the output layer got hidden states of shape "
                    f"{tuple(hidden.shape)} for targets of shape {tuple(pending.targets.shape)}; "
                    "set tiled_compute.logits_loss to false for this model"
                )
            params: list[torch.Tensor] = [p for p in head.parameters() if p.requires_grad]
            pending.loss = tiled_logits_loss(
                swapped.original, hidden, pending.targets, pending.count, params, self.tile,
                self._head_quiet,
            )  # fmt: skip
            return pending.loss

        swapped = _Swapped(head, forward)
        self._swapped.append(swapped)
        return (), named

    def _after(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not self._pending:  # a pre-hook before ours raised: ours never ran
            return None
        pending = self._pending.pop()
        if pending is None:
            return None
        swapped = self._swapped.pop()
        swapped.restore()
        if output is None:
            return None
        return _with_tiled_loss(output, pending, type(module).__name__)


def _with_tiled_loss(output: Any, pending: _PendingLoss, model_name: str) -> Any:
    """The model's output with the tiled loss as `.loss` and no logits."""
    loss = pending.loss
    if isinstance(output, dict):  # transformers' ModelOutput is a dict
        logits, aux = output.get("logits"), output.get("aux_loss")
        rest = output.items()
    else:
        logits, aux = (output[0] if isinstance(output, tuple) and output else None), None
        rest = None
    if loss is None or logits is not loss:
        raise UsageError(
            f"tiled_compute.logits_loss: {model_name}'s forward "
            + ("never called its output layer" if loss is None else "changed its logits after "
               "the output layer (a scale or a cap the tiled loss does not apply)")
            + "; set tiled_compute.logits_loss to false for this model"
        )  # fmt: skip
    if aux is not None:
        raise UsageError(
            f"tiled_compute.logits_loss: {model_name} returns an auxiliary loss (a "
            "mixture-of-experts router's), which its loss adds only when it computes the loss "
            "itself; set tiled_compute.logits_loss to false for this model"
        )
    if rest is None:
        return (loss, *output[1:])
    fields = {key: value for key, value in rest if key != "logits"}
    fields["loss"] = loss
    return type(output)(**fields)
