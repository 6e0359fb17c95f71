"""What the uneven-inputs agreement costs per micro-batch, and where it goes: with shard groups
the micro-batches before the accumulation boundary agree inside their shard group only
([Note: agreeing before a collective] in zerodp/comm/agreement.py).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/agreement_reach.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/agreement_reach.py
    ZERODP_NODE_SIZE=2 OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 \\
        bench/agreement_reach.py --shard-size 2

Stage 3, an MLP, 4 micro-batches per step. For a micro-batch before the boundary and for the
boundary's (its forward, backward and, for the boundary, the optimizer step) it prints the
agreements made inside the shard group and over the world, and the bytes they sent within a
node and across nodes; then the microseconds one agreement takes with the ranks in step
(medians of 9 blocks of 50, alternating between the two kinds), and what the agreements add
up to per micro-batch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import zerodp  # noqa: E402
from zerodp.comm import destroy_process_group_if_owned, ensure_process_group  # noqa: E402
from zerodp.comm.agreement import agreement  # noqa: E402
from zerodp.comm.faults.uneven_inputs import Activity  # noqa: E402

MICRO_BATCHES = 4


def _engine(shard_size: int) -> tuple[object, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": 3,
            "mics_shard_size": shard_size,
            "stage3_param_persistence_threshold": 0,
        },
    }
    engine, *_ = zerodp.initialize(model=model, config=config)
    return engine, model


def _micro_batch(engine: object, step: int, micro: int) -> dict[str, int]:
    """One micro-batch's agreements (inside the shard group, over the world) and their bytes."""
    rank = dist.get_rank()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + micro))
    engine.comm.stats.reset()  # type: ignore[attr-defined]
    made, local = agreement().num_agreed, agreement().num_local
    engine.backward(engine(x).square().mean())  # type: ignore[attr-defined,operator]
    engine.step()  # type: ignore[attr-defined]
    reach = engine.comms.agreement_traffic()  # type: ignore[attr-defined]
    shard = agreement().num_local - local
    return {
        "shard": shard,
        "world": agreement().num_agreed - made - shard,
        "within": reach.get("within a node", 0),
        "across": reach.get("across nodes", 0),
    }


def _per_agreement_us(engine: object, local: bool, count: int = 50, blocks: int = 9) -> float:
    """Microseconds per agreement of one kind with the ranks in step (median of blocks)."""
    comm = engine.comm  # type: ignore[attr-defined]
    label = "shard" if local else "world"
    times = []
    for _ in range(blocks):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            agreement().begin(Activity.FORWARD, local=local)
            comm.agree_first("the benchmark", label)
        times.append(1e6 * (time.perf_counter() - start) / count)
    agreement().reset()  # nothing pending once the blocks are done
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard-size", type=int, default=-1, help="mics_shard_size (-1: flat)")
    args = parser.parse_args()
    ensure_process_group()
    torch.set_num_threads(1)
    engine, _ = _engine(args.shard_size)
    for step in range(2):  # the first step's passes are checked through the store
        for micro in range(MICRO_BATCHES):
            _micro_batch(engine, step, micro)
    rows = [_micro_batch(engine, 2, micro) for micro in range(MICRO_BATCHES)]
    before, boundary = rows[0], rows[-1]
    local_us = _per_agreement_us(engine, local=True) if before["shard"] else 0.0
    world_us = _per_agreement_us(engine, local=False)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        shards = "flat" if args.shard_size < 0 else f"mics_shard_size {args.shard_size}"
        print(f"{world} ranks, {shards}, stage 3, {MICRO_BATCHES} micro-batches per step")
        print("micro-batch       shard  world  bytes within  bytes across  us (agreements)")
        for name, row in (("before boundary", before), ("boundary+step", boundary)):
            cost = row["shard"] * local_us + row["world"] * world_us
            print(
                f"{name:<16} {row['shard']:>6} {row['world']:>6} {row['within']:>13} "
                f"{row['across']:>13} {cost:>16.0f}"
            )
        print(f"us per agreement: inside the shard group {local_us:.0f}, world {world_us:.0f}")
    engine.destroy()  # type: ignore[attr-defined]
    destroy_process_group_if_owned()


if __name__ == "__main__":
    main()
