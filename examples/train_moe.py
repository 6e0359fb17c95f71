"""Train a tiny mixture-of-experts model with expert parallelism, checked against one process.

    torchrun --standalone --nproc_per_node 2 examples/train_moe.py

A Hugging Face Qwen3-MoE (8 experts per layer, top-2, built from a config: no downloads)
trains at ZeRO stage 3 with `"expert_parallel": {"enabled": true, "autoep_size": 2}`: each
rank holds 4 of every layer's 8 experts, its tokens travel to the rank holding their
experts and back. Beside it, rank 0 trains a plain copy on every rank's batches in one
process; the script prints both losses per step and the largest weight difference at the
end (every expert gathered whole). See docs/expert-parallel.md.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import zerodp

VOCAB, SEQ_LEN, EXPERTS = 256, 32, 8


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=SEQ_LEN,
    )
    return Qwen3MoeForCausalLM(config)


def batch(step: int, rank: int, rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (rows, SEQ_LEN), generator=generator)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--experts-per-group", type=int, default=0, help="E (default: world)")
    args = parser.parse_args(argv)
    model = build_model()
    reference = copy.deepcopy(model)
    rows = 4
    size = args.experts_per_group or int(os.environ.get("WORLD_SIZE", "1"))
    engine, *_ = zerodp.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": rows,
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 3},
            "expert_parallel": {"enabled": size > 1, "autoep_size": size},
        },
    )
    world, rank = engine.world_size, engine.global_rank
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(args.steps):
        ids = batch(step, rank, rows)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = 0.0
        for other in range(world):  # one process on every rank's batch
            ids = batch(step, other, rows)
            part = reference(input_ids=ids, labels=ids).loss / world
            part.backward()
            total += float(part.detach())
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().reshape(1).clone()
        engine.comm.all_reduce(mean)
        if rank == 0:
            print(f"step {step}: loss {float(mean) / world:.5f} (one process: {total:.5f})")
    whole = dict(engine.full_parameters())
    worst = max(float((whole[n] - p.detach()).abs().max()) for n, p in reference.named_parameters())
    if rank == 0:
        held = engine.expert_parallel.size if engine.expert_parallel is not None else 1
        print(
            f"experts per rank: {EXPERTS // held} of {EXPERTS}; largest weight difference "
            f"from one process: {worst:.2e}"
        )
    engine.destroy()
    return {"worst": worst}


if __name__ == "__main__":
    main()
