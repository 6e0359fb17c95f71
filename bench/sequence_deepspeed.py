"""DeepSpeed's Ulysses and zerodp's against one process on the whole sequences: gradient, norm.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 \\
        bench/sequence_deepspeed.py [--stages 0 1 2 3]

Backs what docs/sequence-parallel.md says DeepSpeed 0.19.8 and zerodp do. The model is a tiny
Llama (sdpa, 4 query heads, 2 key/value heads, fp32, 16 tokens per row); every rank takes the
same two rows (world size 2: S = 2, D = 1; with 4 ranks, S = 2 x D = 2, replica d its own
rows). The reference, computed first in each process: a plain copy of the model on every
replica's whole rows, the mean loss over replicas, backward. Then, per ZeRO stage, DeepSpeed as
its tutorial for HF Transformers writes it (`UlyssesSPAttentionHF.register_with_transformers`,
`sequence_parallel_size` in the config, the labels shifted and the rows split as its
`UlyssesSPDataLoaderAdapter` does, the loss aggregated with the differentiable all-gather of
the tutorial, `engine.backward`), and what it hands back: each parameter's full gradient
(`deepspeed.utils.safe_get_full_grad`) and, after `engine.step()`, `get_global_grad_norm()`.

zerodp runs in the same processes and the same default process group, per ZeRO stage, before
DeepSpeed's registration replaces transformers' "sdpa": `zerodp.initialize` with
`sequence_parallel_size` in the config, the same model init, every rank of a sequence group
handed its replica's whole rows, and the user's plain loop (`loss = engine(input_ids=...,
labels=...).loss`, `engine.backward(loss)`, `engine.step()`); read the same way (each
parameter's full gradient from `zerodp.utils.safe_get_full_grad` before the step,
`get_global_grad_norm()` after it), then `engine.destroy()`.

Printed per stage, for DeepSpeed and zerodp side by side: the gradient as a multiple of the
reference's (the least-squares factor <g, g_ref> / <g_ref, g_ref>), how far the gradient is
from that multiple (relative), the grad norm's ratio to the reference's; and the batch size
DeepSpeed derived (train_batch_size for a micro batch of 2 and no accumulation: it counts
world size / S ranks). DeepSpeed's comm op build is skipped as in bench/_deepspeed.py.

`--aggregation all_reduce` sums the token-weighted losses with torch's differentiable
all-reduce instead, the workaround the tutorial names for the all-gather's backward: on gloo
that backward (an all-to-all emulated with scatter) fails on a sequence group that does not
start at rank 0, so 4 ranks need it. Both give every rank the gradient of the sum of all the
group's parts (backward of a sum over ranks is a sum over ranks).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._deepspeed import _skip_shm_op_build, ulysses_slice_loss

SEQUENCE = 2
ROWS = 2
LENGTH = 16
VOCAB = 96


def build_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def rows(replica: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + replica)
    return torch.randint(3, VOCAB, (ROWS, LENGTH), generator=generator)


def reference_gradients(model: Any, replicas: int) -> dict[str, torch.Tensor]:
    """One process on the whole rows of every replica: the mean of their losses."""
    reference = copy.deepcopy(model)
    for replica in range(replicas):
        ids = rows(replica)
        (reference(input_ids=ids, labels=ids).loss / replicas).backward()
    return {name: p.grad.detach().clone() for name, p in reference.named_parameters()}


def deepspeed_stage(
    model: Any, stage: int, replica: int, mpu: Any, aggregation: str
) -> dict[str, Any]:
    import deepspeed
    from deepspeed.utils import groups, safe_get_full_grad

    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1e6,  # never clips; makes stage 0 compute the norm it reports
        "sequence_parallel_size": SEQUENCE,
        "zero_allow_untested_optimizer": True,  # torch's SGD at stages 1-3
        "steps_per_print": 1000,
    }
    params = list(model.parameters())
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=params, config=config, mpu=mpu
    )
    group = groups._get_sequence_parallel_group()
    size = groups._get_sequence_parallel_world_size()
    rank = groups._get_sequence_parallel_rank()
    _, loss, count = ulysses_slice_loss(engine, rows(replica), rank, size)
    # The tutorial's differentiable, token-weighted aggregation over the sequence group.
    if aggregation == "all_gather":
        losses = torch.distributed.nn.functional.all_gather(loss, group=group)
        tokens = torch.distributed.nn.functional.all_gather(count, group=group)
        total = sum(losses[r] * tokens[r] for r in range(size)) / max(sum(tokens), 1)
    else:
        weighted = torch.distributed.nn.functional.all_reduce(loss * count, group=group)
        tokens = count.detach().clone()
        dist.all_reduce(tokens, group=group)
        total = weighted / tokens.clamp(min=1)
    engine.backward(total)
    grads = {
        name: safe_get_full_grad(p).detach().clone() for name, p in engine.module.named_parameters()
    }
    engine.step()
    norm = engine.get_global_grad_norm()
    result = {
        "grads": grads,
        "norm": None if norm is None else float(norm),
        "loss": float(total.detach()),
        "train_batch_size": engine.train_batch_size(),
    }
    engine.destroy()
    return result


def zerodp_stage(model: Any, stage: int, replica: int) -> dict[str, Any]:
    """zerodp on the same rows with the user's plain loop; read as `deepspeed_stage` reads."""
    import zerodp
    from zerodp.utils import safe_get_full_grad

    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "sequence_parallel_size": SEQUENCE,
        "steps_per_print": 1000,
    }
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    try:
        ids = rows(replica)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        grads = {name: safe_get_full_grad(p) for name, p in engine.module.named_parameters()}
        engine.step()
        norm = engine.get_global_grad_norm()
    finally:
        engine.destroy()
    return {"grads": grads, "norm": None if norm is None else float(norm)}


def norm_ratio(norm: float | None, expected: float) -> str:
    return "not reported" if norm is None else f"{norm / expected:.4f}"


def compare(
    got: dict[str, torch.Tensor | None], expected: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """The least-squares factor of `got` on `expected`, and the relative rest (None: zero)."""
    g = torch.cat(
        [(torch.zeros_like(e) if got[n] is None else got[n]).flatten() for n, e in expected.items()]
    )
    e = torch.cat([expected[n].flatten() for n in expected])
    factor = float(g @ e / (e @ e))
    off = float((g - factor * e).norm() / e.norm())
    return factor, off


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--aggregation", choices=("all_gather", "all_reduce"), default="all_gather")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    _skip_shm_op_build()
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    replicas = world // SEQUENCE
    replica = dist.get_rank() // SEQUENCE
    model = build_model()
    expected = reference_gradients(model, replicas)
    expected_norm = float(torch.cat([g.flatten() for g in expected.values()]).norm())
    # zerodp first: DeepSpeed's registration below replaces transformers' "sdpa" for good.
    ours = {stage: zerodp_stage(copy.deepcopy(model), stage, replica) for stage in args.stages}
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=SEQUENCE,
        micro_batch_size=ROWS,
        seq_length=LENGTH,
        seq_length_is_variable=True,
    )
    lines = [
        f"DeepSpeed {deepspeed.__version__} and zerodp, world size {world} "
        f"(sequence_parallel_size {SEQUENCE} x {replicas} data-parallel), fp32, DeepSpeed with "
        f"the tutorial's loss aggregation ({args.aggregation}), zerodp with the plain loop",
        "| ZeRO stage | gradient / reference: DeepSpeed | zerodp | off that multiple: DeepSpeed "
        "| zerodp | grad norm / reference: DeepSpeed | zerodp | DeepSpeed's train_batch_size |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for stage in args.stages:
        result = deepspeed_stage(copy.deepcopy(model), stage, replica, mpu, args.aggregation)
        factor, off = compare(result["grads"], expected)
        our_factor, our_off = compare(ours[stage]["grads"], expected)
        norms = [norm_ratio(r["norm"], expected_norm) for r in (result, ours[stage])]
        batch = result["train_batch_size"]
        lines.append(
            f"| {stage} | {factor:.4f} | {our_factor:.4f} | {off:.1e} | {our_off:.1e} "
            f"| {norms[0]} | {norms[1]} | {batch:g} |"
        )
    if dist.get_rank() == 0:
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
