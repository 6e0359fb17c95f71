"""Train a small mixture-of-experts GPT at ZeRO stage 3, its MoE layers marked as leaves.

    torchrun --standalone --nproc_per_node 2 examples/train_moe.py [--steps 200]

Byte-level, on the Python standard library's sources (no downloads, as `train_gpt.py`).
Every rank's batch routes its tokens to its own experts, so ranks run different experts;
marking each `MoE` layer as a stage 3 leaf (`zerodp.zero.set_z3_leaf_modules`) makes it one
unit whose parameters are gathered together, so the ranks' collectives still match. Rank 0
prints the loss and, per rank, how many experts got no token in the last step.
`--no-leaves` shows what happens without the marking: every rank stops at the first step
with a `zerodp.DivergenceError` naming the experts each rank was gathering.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import zerodp  # noqa: E402
from examples.moe_gpt import MoEGPT, MoEGPTConfig  # noqa: E402
from examples.stdlib_text import load_corpus  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--print-every", type=int, default=20)
    p.add_argument("--no-leaves", action="store_true", help="do not mark the MoE layers")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    cfg = MoEGPTConfig(
        vocab_size=256,
        seq_len=args.seq_len,
        n_layer=args.n_layer,
        n_head=4,
        d_model=args.d_model,
        num_experts=args.experts,
        top_k=args.top_k,
        d_expert=2 * args.d_model,
    )
    torch.manual_seed(1234)
    model = MoEGPT(cfg)
    if not args.no_leaves:
        zerodp.zero.set_z3_leaf_modules(model, list(MoEGPT.LEAF_CLASSES))
    corpus = load_corpus(args.seq_len, max_train_bytes=2 << 20, max_valid_bytes=1 << 16)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000},
        "seed": 1234,
    }
    engine, _, loader, _ = zerodp.initialize(model=model, config=config, training_data=corpus.train)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"{model.num_params():,} parameters, {world} ranks, ZeRO stage 3", flush=True)
    start = time.perf_counter()
    step = 0
    while step < args.steps:
        for inputs, targets in loader:
            logits = engine(inputs.to(engine.device))
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.to(engine.device).reshape(-1)
            )
            engine.backward(loss)
            engine.step()
            step += 1
            if step % args.print_every == 0 or step == args.steps:
                idle = torch.tensor([model.idle_experts()], device=engine.device)
                idle_all = [torch.empty_like(idle) for _ in range(world)]
                dist.all_gather(idle_all, idle)
                if rank == 0:
                    per_rank = ", ".join(str(int(t.item())) for t in idle_all)
                    print(
                        f"step {step:4d}  loss {loss.item():.3f}  idle experts per rank "
                        f"[{per_rank}]  {time.perf_counter() - start:.0f}s",
                        flush=True,
                    )
            if step >= args.steps:
                break
    engine.destroy()
    zerodp.comm.destroy_process_group_if_owned()
    return 0


if __name__ == "__main__":
    sys.exit(main())
