"""The model, data and reference of bench/expert_parallel.py, and DeepSpeed AutoEP's patch.

The model is a Hugging Face Qwen3-MoE built from a config (no download) with the
proportions of Qwen3-30B-A3B scaled down: the experts hold almost every parameter
(87% here, 95% there), each expert's MLP is half the hidden size wide (0.375 there),
4 query heads share 2 key/value heads, normalised top-k routing. Top-2 of
`num_experts` (32 by default). Every call of `build_model` gives the same weights.

The reference is one process training the whole model on every rank's batch (each
rank's mean loss divided by the world size: the mean every data-parallel engine
computes), its gradients clipped to a global norm of 1 (the engines' default
`gradient_clipping`, which this model's first steps exceed: so the global norm over
split experts is tested too), with the same torch optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MODEL: dict[str, int] = {
    "vocab": 1024,
    "hidden": 128,
    "layers": 4,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 32,
    "moe_intermediate": 64,
    "experts": 32,
    "top_k": 2,
}
MICRO = 4  # rows per rank per step
LENGTH = 64  # tokens per row
SEED = 1234
CLIP = 1.0  # gradient_clipping: DeepSpeed's and zerodp's default, active on this model


def build_model(model: dict[str, int], seed: int = SEED) -> nn.Module:
    """The Qwen3-MoE of `model`'s sizes, fp32, from `seed`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=model["vocab"],
        hidden_size=model["hidden"],
        num_hidden_layers=model["layers"],
        num_attention_heads=model["heads"],
        num_key_value_heads=model["kv_heads"],
        head_dim=model["head_dim"],
        intermediate_size=4 * model["moe_intermediate"],  # dense layers only; there are none
        moe_intermediate_size=model["moe_intermediate"],
        num_experts=model["experts"],
        num_experts_per_tok=model["top_k"],
        norm_topk_prob=True,
        max_position_embeddings=LENGTH,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    return Qwen3MoeForCausalLM(config)


def layer_numel(model: dict[str, int]) -> int:
    """Parameters of one decoder layer: attention, its norms, the router, the experts."""
    hidden, head = model["hidden"], model["head_dim"]
    attention = 2 * hidden * head * (model["heads"] + model["kv_heads"]) + 2 * head
    experts = model["experts"] * (3 * hidden * model["moe_intermediate"] + hidden)
    return attention + experts + 2 * hidden


# Qwen3-30B-A3B's decoder layer: 128 experts of 3 x 2048 x 768, a router, attention with 32
# query and 4 key/value heads of 128 (623 M; 48 layers and embeddings make 30.5 B).
QWEN3_30B_LAYER = 623_000_000


def stage3_knobs(model: dict[str, int]) -> dict[str, int]:
    """DeepSpeed's (and zerodp's) stage 3 defaults, scaled from Qwen3-30B-A3B's layer to this
    model's: prefetch 5e7 elements, at most 1e9 gathered, kept while reused within 1e9,
    gradients reduced in buckets of 5e8. Unscaled, a model this small would be gathered
    whole from its forward to its backward and its gradients reduced all at once at the
    end, which no real MoE model is; scaled, at most about 1.6 layers are gathered at once
    and a bucket holds 0.8 of a layer's gradients.
    Every element of a matrix is sharded (a persistence threshold of 1000 keeps the norms)."""
    scale = layer_numel(model) / QWEN3_30B_LAYER
    return {
        "stage3_prefetch_bucket_size": max(1, int(5e7 * scale)),
        "stage3_max_live_parameters": max(1, int(1e9 * scale)),
        "stage3_max_reuse_distance": max(1, int(1e9 * scale)),
        "reduce_bucket_size": max(1, int(5e8 * scale)),
        "stage3_param_persistence_threshold": 1000,
    }


def is_expert_name(name: str) -> bool:
    """An expert tensor of the HF model (`...mlp.experts.gate_up_proj` / `down_proj`)."""
    return ".mlp.experts." in name


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(all parameters, expert parameters)."""
    named = list(model.named_parameters())
    return sum(p.numel() for _, p in named), sum(p.numel() for n, p in named if is_expert_name(n))


def batch_for(step: int, rank: int, vocab: int) -> torch.Tensor:
    """Rank `rank`'s rows at `step`: the same in every engine and in the reference."""
    generator = torch.Generator().manual_seed(100_000 + 1000 * step + rank)
    return torch.randint(3, vocab, (MICRO, LENGTH), generator=generator)


@dataclass(frozen=True)
class OptimizerSpec:
    """One torch optimizer, as zerodp's config names it and as a factory for the others."""

    name: str
    lr: float
    weight_decay: float

    def zerodp_block(self) -> dict[str, Any]:
        return {"type": self.name, "params": {"lr": self.lr, "weight_decay": self.weight_decay}}

    def build(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        kind = {"AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}[self.name]
        return kind(params, lr=self.lr, weight_decay=self.weight_decay)


OPTIMIZERS = {
    "adamw": OptimizerSpec("AdamW", lr=1e-3, weight_decay=0.01),
    "sgd": OptimizerSpec("SGD", lr=0.1, weight_decay=0.0),
}


class RoutingLog:
    """The experts each token was sent to, per MoE layer, in the last forward.

    A forward hook on every router: the model's own (`...TopKRouter`, indices third in its
    output) or AutoEP's (`TokenChoiceTopKRouter`, second). Indices are sorted per token, so
    two logs compare as sets of experts. A MoE model's routing is discrete: a difference in
    the last bit of a router's input can send a nearly tied token to another expert, and
    from then on the runs differ by more than round-off. Counting the tokens routed
    differently tells such a flip from an error.
    """

    def __init__(self, model: nn.Module) -> None:
        self.choices: list[torch.Tensor] = []
        for module in model.modules():
            name = type(module).__name__
            if name == "TokenChoiceTopKRouter":
                module.register_forward_hook(self._hook(1))
            elif name.endswith("TopKRouter"):
                module.register_forward_hook(self._hook(2))

    def _hook(self, position: int) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            self.choices.append(output[position].detach().sort(dim=-1).values)

        return record

    def take(self) -> list[torch.Tensor]:
        """The last forward's choices, one [tokens, K] tensor per layer; the log empties."""
        out, self.choices = self.choices, []
        return out


def routing_differences(got: list[torch.Tensor], expected: list[torch.Tensor]) -> int:
    """Tokens x layers whose set of experts differs."""
    if len(got) != len(expected):
        raise AssertionError(f"{len(got)} router calls against {len(expected)}")
    return sum(int((a != b).any(dim=-1).sum()) for a, b in zip(got, expected, strict=True))


@dataclass
class Reference:
    """One process on every rank's rows: the weights after the last step, every loss, every
    routing choice."""

    weights: dict[str, torch.Tensor]
    losses: list[list[float]]  # [step][rank]
    routes: list[list[list[torch.Tensor]]]  # [step][rank][layer]
    by_step: list[dict[str, torch.Tensor]]  # the weights after each step (if asked for)


def reference_run(
    model: dict[str, int],
    optimizer: OptimizerSpec,
    steps: int,
    world: int,
    every_step: bool = False,
) -> Reference:
    net = build_model(model)
    log = RoutingLog(net)
    opt = optimizer.build(net.parameters())
    losses: list[list[float]] = []
    routes: list[list[list[torch.Tensor]]] = []
    by_step: list[dict[str, torch.Tensor]] = []
    for step in range(steps):
        row, chosen = [], []
        for rank in range(world):
            ids = batch_for(step, rank, model["vocab"])
            loss = net(input_ids=ids, labels=ids).loss
            row.append(loss.item())
            chosen.append(log.take())
            (loss / world).backward()
        losses.append(row)
        routes.append(chosen)
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        if every_step:
            by_step.append({n: p.detach().clone() for n, p in net.named_parameters()})
    weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    return Reference(weights, losses, routes, by_step)


def largest_difference(
    got: Iterator[tuple[str, torch.Tensor]],
    expected: Callable[[str], torch.Tensor],
    names: Iterable[str],
) -> float:
    """The largest |got - expected| over every tensor; every name in `names` must be seen."""
    worst, seen = 0.0, set()
    for name, value in got:
        want = expected(name)
        if value.shape != want.shape:
            raise AssertionError(f"{name}: {tuple(value.shape)} against {tuple(want.shape)}")
        worst = max(worst, (value.detach().float() - want).abs().max().item())
        seen.add(name)
    missing = set(names) - seen
    if missing:
        raise AssertionError(f"weights not compared: {sorted(missing)[:5]} ...")
    return worst


# --- DeepSpeed 0.19.8's AutoEP with transformers 5.25.0 -------------------------------

AUTOEP_PATCH = (
    "transformers.utils.output_capturing._CanRecordRegistry.get(self, key) takes a model "
    "and no default; DeepSpeed's AutoEP output-recorder retargeting calls it as a dict, "
    "with a class-name string and a default. Bench-process monkeypatch: a string key (with "
    "an optional default) is looked up as in a plain dict; a model as before."
)


def patch_autoep_output_recorders() -> None:
    """The smallest change that lets AutoEP start with the pinned transformers: in this
    process only, `_CanRecordRegistry.get` also answers dict-style lookups by key string
    (see AUTOEP_PATCH). No file is edited."""
    from transformers.utils import output_capturing

    registry = output_capturing._CanRecordRegistry
    original = registry.get
    if getattr(original, "_bench_patched", False):
        return

    def get(self: Any, key: Any, *default: Any) -> Any:
        if isinstance(key, str):
            return dict.get(self, key, *default)
        return original(self, key)

    get._bench_patched = True  # type: ignore[attr-defined]
    setattr(registry, "get", get)  # noqa: B010 (a method replaced on the class)


def deepspeed_reference_view(
    reference: dict[str, torch.Tensor], name: str, ep_rank: int, ep_size: int
) -> torch.Tensor:
    """The one-process value of AutoEP's parameter `name`: its router is the model's
    `mlp.gate`; its grouped experts w1 (gate), w3 (up) and w2 (down) are this EP rank's
    experts of the fused `gate_up_proj` [N, 2I, H] (gate rows first) and `down_proj`."""
    if ".mlp.router.gate." in name:
        return reference[name.replace(".mlp.router.gate.", ".mlp.gate.")]
    if ".mlp.experts.w" not in name:
        return reference[name]
    prefix, tensor = name.rsplit(".", 1)
    if tensor == "w2":
        whole = reference[f"{prefix}.down_proj"]
    else:
        fused = reference[f"{prefix}.gate_up_proj"]
        half = fused.shape[1] // 2
        whole = fused[:, :half] if tensor == "w1" else fused[:, half:]
    local = whole.shape[0] // ep_size
    return whole[ep_rank * local : (ep_rank + 1) * local]
