"""The expert-parallel layer against one process, without the engine (importable by workers).

`parity` splits a tiny HF MoE model's experts over an EP group (each rank a
copy of the same model), runs each rank's own batch through it and backward,
and compares with the unsplit model run in the worker on every rank's batch,
one rank's batch at a time (so any sum over ranks can be formed):

- this rank's logits, loss, auxiliary load-balancing loss and input gradient
  against the reference on the same batch;
- every ordinary parameter (router, attention, norms, shared experts): its
  gradient summed over all ranks against the sum of the reference's;
- every expert slice: its gradient, as it is (no reduction), against the same
  slice of the reference's gradient summed over the ranks of this rank's EP group;
  summed over the expert-data group (the ranks holding the same experts), against
  the slice of the sum over all ranks;
- what each experts module held while it ran, the names, and the whole tensors
  gathered back from the slices.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.hf_moe_models import (
    HIDDEN,
    NUM_EXPERTS,
    TOP_K,
    build,
    experts_of,
    route_only_to,
    token_batch,
)
from zerodp.comm import Comm
from zerodp.comm.stats import CollectiveKind
from zerodp.expert_parallel import ExpertSplit, split_experts


def forward_backward(model: nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """Logits, loss, aux loss and the input embeddings' gradient of one batch (backward run)."""
    embeds = model.get_input_embeddings()(ids)
    embeds.retain_grad()
    out = model(inputs_embeds=embeds, labels=ids, output_router_logits=True)
    out.loss.backward()
    aux = getattr(out, "aux_loss", None)
    return {
        "logits": out.logits.detach(),
        "loss": out.loss.detach(),
        "aux": None if aux is None else aux.detach(),
        "input_grad": embeds.grad.detach(),
    }


def reference_runs(reference: nn.Module, world: int) -> list[dict[str, Any]]:
    """The unsplit model on each rank's batch, one at a time, with that batch's gradients."""
    runs = []
    for rank in range(world):
        reference.zero_grad(set_to_none=True)
        run = forward_backward(reference, token_batch(rank))
        run["grads"] = {
            n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
            for n, p in reference.named_parameters()
        }
        runs.append(run)
    return runs


def watch_experts(model: nn.Module) -> list[dict[str, Any]]:
    """What each experts module holds while it runs, and which experts its tokens chose."""
    seen: list[dict[str, Any]] = [{"held": set(), "chosen": set()} for _ in experts_of(model)]
    for record, module in zip(seen, experts_of(model), strict=True):

        def pre_hook(module: nn.Module, args: tuple[Any, ...], record=record) -> None:
            record["held"].add((module.num_experts, module.gate_up_proj.shape[0]))
            record["chosen"].update(args[1].reshape(-1).tolist())

        module.register_forward_pre_hook(pre_hook)
    return seen


def _max(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The largest elementwise difference over the pairs (each pair of the same shape)."""
    worst = 0.0
    for a, b in pairs:
        if a.shape != b.shape:
            raise AssertionError(f"shapes differ: {tuple(a.shape)} and {tuple(b.shape)}")
        if a.numel():
            worst = max(worst, (a - b).abs().max().item())
    return worst


def parity(
    name: str,
    size: int,
    groups: Sequence[Sequence[int]],
    *,
    patterns: Sequence[str] | None = None,
    idle_pairs: int = 0,
    implementation: str = "grouped_mm",
    checkpointed: bool = False,
) -> dict[str, Any]:
    """Split `name` over EP groups `groups` (ranks of each, E = `size`) and compare (see the
    module docstring); every rank calls it. `checkpointed`: both models recompute each
    decoder layer in backward (the dispatch runs again there)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(name, implementation=implementation)
    idle = route_only_to(model, idle_pairs) if idle_pairs else []
    reference = copy.deepcopy(model)
    if checkpointed:
        for each in (model, reference):
            each.gradient_checkpointing_enable()
    world_comm = Comm()
    comms = [Comm(dist.new_group(list(g)), label="expert", parent=world_comm) for g in groups]
    # The expert-data groups: the ranks at the same place of every EP group.
    same_place = [dist.new_group(list(ranks)) for ranks in zip(*groups, strict=True)]
    (mine,) = [g for g in groups if rank in g]
    place = list(mine).index(rank)
    seen = watch_experts(model)
    split = split_experts(model, size, place, comms[list(groups).index(mine)], patterns)
    run = forward_backward(model, token_batch(rank))
    expected = reference_runs(reference, world)
    out = _compare_outputs(run, expected[rank])
    out |= _compare_grads(model, split, expected, mine, same_place[place])
    chosen: list[set[int]] = [set() for _ in seen]
    everyone = [None] * world
    dist.all_gather_object(everyone, [sorted(s["chosen"]) for s in seen])
    for per_rank in everyone:
        for layer, experts in enumerate(per_rank or []):
            chosen[layer].update(experts)
    out["chosen_idle"] = sorted({e for layer in chosen for e in layer} & set(idle))
    out["idle_grads_zero"] = _idle_grads_zero(model, split, idle)
    out["held"] = sorted({h for s in seen for h in s["held"]})
    out["names_kept"] = list(model.state_dict()) == list(reference.state_dict())
    out["whole_equal"] = _whole_equal(model, split, reference)
    out["classes"] = sorted({type(m).__name__ for m in experts_of(model)})
    return out


def _compare_outputs(run: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    out = {
        "logits": _max([(run["logits"], expected["logits"])]),
        "loss": _max([(run["loss"], expected["loss"])]),
        "input_grad": _max([(run["input_grad"], expected["input_grad"])]),
    }
    if expected["aux"] is not None:
        out["aux"] = _max([(run["aux"], expected["aux"])])
    return out


def _compare_grads(
    model: nn.Module,
    split: ExpertSplit,
    expected: list[dict[str, Any]],
    group: Sequence[int],
    expert_data_group: Any,
) -> dict[str, Any]:
    """Ordinary gradients summed over all ranks; expert slices as they are, and summed over the
    ranks holding the same experts (the same place in every EP group)."""
    ordinary, experts, expert_data = [], [], []
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            raise AssertionError(f"'{name}' has no gradient")
        if split.is_expert(param):
            record = split.expert_of(name)
            if record is None:
                raise AssertionError(f"'{name}' is an expert slice without a record")
            first, local = record.slice.first_expert, record.slice.local_experts
            in_group = sum(expected[r]["grads"][name] for r in group).narrow(0, first, local)
            experts.append((grad, in_group))
            summed = grad.clone()
            dist.all_reduce(summed, group=expert_data_group)
            everyone = sum(run["grads"][name] for run in expected).narrow(0, first, local)
            expert_data.append((summed, everyone))
        else:
            summed = grad.clone()
            dist.all_reduce(summed)
            ordinary.append((summed, sum(run["grads"][name] for run in expected)))
    return {
        "ordinary_grads": _max(ordinary),
        "expert_grads": _max(experts),
        "expert_data_grads": _max(expert_data),
        "num_expert_tensors": len(experts),
    }


def _idle_grads_zero(model: nn.Module, split: ExpertSplit, idle: list[int]) -> bool:
    """Every expert slice has a gradient, and it is exactly zero for the idle experts here."""
    for name, param in model.named_parameters():
        record = split.expert_of(name)
        if record is None:
            continue
        if param.grad is None:
            return False
        first = record.slice.first_expert
        for expert in idle:
            if expert in record.slice.experts and torch.count_nonzero(param.grad[expert - first]):
                return False
    return True


def _whole_equal(model: nn.Module, split: ExpertSplit, reference: nn.Module) -> bool:
    whole = dict(reference.named_parameters())
    return all(
        torch.equal(split.whole_value_named(name, param.detach()), whole[name].detach())
        for name, param in model.named_parameters()
        if split.is_expert(param)
    )


def module_inputs(rank: int, tokens: int = 6) -> dict[str, torch.Tensor]:
    """Rank `rank`'s own router choice for one experts module: indices in [0, N], where N is
    the model's own sentinel for a masked slot, and weights."""
    generator = torch.Generator().manual_seed(50 + rank)
    return {
        "hidden": torch.randn(tokens, HIDDEN, generator=generator),
        "index": torch.randint(0, NUM_EXPERTS + 1, (tokens, TOP_K), generator=generator),
        "weights": torch.rand(tokens, TOP_K, generator=generator),
        "probe": torch.randn(tokens, HIDDEN, generator=generator),
    }


def _module_run(experts: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    hidden = inputs["hidden"].clone().requires_grad_()
    weights = inputs["weights"].clone().requires_grad_()
    out = experts(hidden, inputs["index"], weights)
    (out * inputs["probe"]).sum().backward()
    return {"out": out.detach(), "hidden": hidden.grad, "weights": weights.grad}


def sentinel_and_bytes(implementation: str) -> dict[str, Any]:
    """One experts module (Qwen3-MoE's, layer 0) split at E = world over a group labelled
    "expert", fed slots the model masks (index N); against the unsplit module on every rank's
    inputs; and the all-to-all bytes this rank's stats counted, against their closed form."""
    rank, world = dist.get_rank(), dist.get_world_size()
    block = build("qwen3_moe", implementation=implementation).model.layers[0].mlp
    reference = copy.deepcopy(block.experts)
    comm = Comm(dist.new_group(list(range(world))), label="expert", parent=Comm())
    split = split_experts(block, world, rank, comm, ["experts"])
    comm.stats.reset()
    mine = _module_run(block.experts, module_inputs(rank))
    sent = comm.stats.by_group[("expert", CollectiveKind.ALL_TO_ALL)]
    calls = comm.stats.calls[CollectiveKind.ALL_TO_ALL]
    expected = [_module_run(reference, module_inputs(r)) for r in range(world)]
    out = {
        "out": _max([(mine["out"], expected[rank]["out"])]),
        "hidden_grad": _max([(mine["hidden"], expected[rank]["hidden"])]),
        "weights_grad": _max([(mine["weights"], expected[rank]["weights"])]),
        "masked_weights_grad": _masked_weight_grads(mine["weights"], module_inputs(rank)),
    }
    slices = []
    for attribute in ("gate_up_proj", "down_proj"):
        record = split.expert_of(f"experts.{attribute}")
        grad = getattr(block.experts, attribute).grad
        whole = getattr(reference, attribute).grad  # every rank's inputs, summed
        held = record.slice
        slices.append((grad, whole.narrow(0, held.first_expert, held.local_experts)))
    out["expert_grads"] = _max(slices)
    out["bytes"], out["expected_bytes"] = sent, _closed_form_bytes(rank, world)
    out["calls"] = calls
    return out


def _masked_weight_grads(grad: torch.Tensor, inputs: dict[str, torch.Tensor]) -> float:
    """The largest gradient of a masked slot's weight (it must be exactly zero)."""
    masked = inputs["index"] == NUM_EXPERTS
    return grad[masked].abs().max().item() if masked.any() else 0.0


def _closed_form_bytes(rank: int, world: int) -> int:
    """What one forward and backward sends to other ranks: the counts (n int64 per other
    rank), and each row (H fp32) that leaves its rank twice: out and back in the forward
    for this rank's assignments to other ranks' experts, and for other ranks' assignments
    to this rank's experts, back and out again in the backward."""
    local = NUM_EXPERTS // world
    owner = [e // local for e in range(NUM_EXPERTS)]
    away = 0  # this rank's valid assignments to experts held elsewhere
    arriving = 0  # other ranks' valid assignments to experts held here
    for source in range(world):
        for expert in module_inputs(source)["index"].reshape(-1).tolist():
            if expert >= NUM_EXPERTS:
                continue
            if source == rank and owner[expert] != rank:
                away += 1
            if source != rank and owner[expert] == rank:
                arriving += 1
    counts = (world - 1) * local * 8
    return counts + 2 * (away + arriving) * HIDDEN * 4


def _penalty_run(experts: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A gradient penalty: the input gradient taken with create_graph, its square summed and
    differentiated again (through the reversed exchanges' own backward)."""
    hidden = inputs["hidden"].clone().requires_grad_()
    weights = inputs["weights"].clone().requires_grad_()
    out = experts(hidden, inputs["index"], weights)
    (grad,) = torch.autograd.grad((out * inputs["probe"]).sum(), hidden, create_graph=True)
    grad.pow(2).sum().backward()
    return {"hidden": hidden.grad, "weights": weights.grad}


def double_backward() -> dict[str, float]:
    """One experts module (Qwen3-MoE's eager loop) split at E = world, under a gradient
    penalty, against the unsplit module on every rank's inputs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    block = build("qwen3_moe", implementation="eager").model.layers[0].mlp
    reference = copy.deepcopy(block.experts)
    comm = Comm(dist.new_group(list(range(world))), label="expert", parent=Comm())
    split = split_experts(block, world, rank, comm, ["experts"])
    mine = _penalty_run(block.experts, module_inputs(rank))
    expected = [_penalty_run(reference, module_inputs(r)) for r in range(world)]
    slices = []
    for attribute in ("gate_up_proj", "down_proj"):
        held = split.modules["experts"]
        whole = getattr(reference, attribute).grad
        slices.append(
            (
                getattr(block.experts, attribute).grad,
                whole.narrow(0, held.first_expert, held.local_experts),
            )
        )
    pairs = {
        "hidden_grad": [(mine["hidden"], expected[rank]["hidden"])],
        "weights_grad": [(mine["weights"], expected[rank]["weights"])],
        "expert_grads": slices,
    }
    # Relative to the largest element: a penalty's gradients are small.
    return {
        key: _max(found) / max(b.abs().max().item() for _, b in found)
        for key, found in pairs.items()
    } | {"expert_grad_size": max(b.abs().max().item() for _, b in slices)}


def empty_batch_on_one_rank() -> dict[str, Any]:
    """Rank 1 has no token (its experts still serve rank 0's); against the unsplit module."""
    rank, world = dist.get_rank(), dist.get_world_size()
    block = build("qwen3_moe").model.layers[0].mlp
    reference = copy.deepcopy(block.experts)
    comm = Comm(dist.new_group(list(range(world))), label="expert", parent=Comm())
    split = split_experts(block, world, rank, comm, ["experts"])
    sizes = [6 if r == 0 else 0 for r in range(world)]
    inputs = [_valid_only(module_inputs(r, sizes[r])) for r in range(world)]
    mine = _module_run(block.experts, inputs[rank])
    expected = [_module_run(reference, inputs[r]) for r in range(world)]
    held = split.modules["experts"]
    slices = [
        (
            getattr(block.experts, a).grad,
            getattr(reference, a).grad.narrow(0, held.first_expert, held.local_experts),
        )
        for a in ("gate_up_proj", "down_proj")
    ]
    return {
        "shape": tuple(mine["out"].shape),
        "out": _max([(mine["out"], expected[rank]["out"])]),
        "hidden_grad": _max([(mine["hidden"], expected[rank]["hidden"])]),
        "expert_grads": _max(slices),
    }


def _valid_only(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same inputs with every slot naming a real expert (grouped_mm's own forward does not
    take the eager loop's sentinel)."""
    return inputs | {"index": inputs["index"] % NUM_EXPERTS}
