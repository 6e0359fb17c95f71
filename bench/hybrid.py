"""Bytes within a node and across nodes per step: flat stage 3, shard groups, hpZ, FSDP2's HSDP.

    ZERODP_NODE_SIZE=2 OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 \
        bench/hybrid.py [--gas 1,4] [--dim 256] [--layers 4] [--steps 0] [--json out.json]

On one machine the 4 ranks are 2 simulated nodes of 2 (`ZERODP_NODE_SIZE`, or
`--node-size`); on real nodes (or `bench/slow_link.sh`, which puts each
simulated node in its own network namespace behind a rate-limited link) the
node size comes from torchrun. Every engine trains its own copy of one seeded
MLP (`--layers` blocks of Linear(dim, dim) + GELU) with AdamW, stage 3 with
every parameter sharded, prefetch off and nothing kept between passes, so that
each block is gathered once per forward and once per backward and the bytes
follow `bench/_hybrid_math.py`'s closed form:

- `zerodp_flat`: `zero_optimization.stage` 3, sharded over all ranks;
- `zerodp_shard2`: `mics_shard_size` 2 (shard groups inside a node);
- `zerodp_hpz2`: `zero_hpz_partition_size` 2 (secondary shards inside a node);
- `fsdp2`: `fully_shard` on each block and the root over all ranks;
- `hsdp`: the same on a 2-D mesh (replicate across nodes, shard within), reduce-scattering
  every micro-batch and all-reducing across replicas at the last (`set_requires_all_reduce`).

Bytes are counted as zerodp's `Comm` counts them (the full tensor of each collective: an
all-gather's output, a reduce-scatter's input, an all-reduce's tensor); zerodp's come from
`engine.comms.traffic()`, FSDP2's from torch.distributed's calls, each attributed to the
process group it ran in and that group's reach (its ranks on one node or on several).
With `--steps N` each engine is also timed over N steps (the slowest rank's time).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import zerodp  # noqa: E402
from bench._hybrid_math import stage3_step_bytes  # noqa: E402
from bench._measure import sharded_model_state_bytes  # noqa: E402
from zerodp.comm import destroy_process_group_if_owned, ensure_process_group  # noqa: E402

ENGINES = ("zerodp_flat", "zerodp_shard2", "zerodp_hpz2", "fsdp2", "hsdp")
ZERODP_GROUPS = {"zerodp_flat": (-1, 1), "zerodp_shard2": (2, 1), "zerodp_hpz2": (-1, 2)}
WITHIN, ACROSS = "within a node", "across nodes"
_MB = 1e6


def make_model(dim: int, layers: int) -> nn.Sequential:
    torch.manual_seed(1234)
    return nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(layers)])


def batches(rank: int, gas: int, micro: int, dim: int, steps: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [
        [torch.randn(micro, dim, generator=generator) for _ in range(gas)] for _ in range(steps)
    ]


# -- torch.distributed's collectives, by process group ---------------------------------------

# name -> (kind, the argument that sizes it); every one of them takes `group`
_CALLS = {
    "all_gather_single": ("all_gather", "output_tensor"),  # torch 2.13's names (FSDP2's)
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
}


class GroupCounter:
    """Bytes of torch.distributed's collectives while `active()`, by the reach of their group."""

    def __init__(self, node_size: int) -> None:
        self.node_size = node_size
        self.bytes: Counter[str] = Counter()
        self._depth = 0

    def _reach(self, group: Any) -> str:
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        ranks = ranks or list(range(dist.get_world_size()))
        return ACROSS if len({r // self.node_size for r in ranks}) > 1 else WITHIN

    @contextlib.contextmanager
    def active(self) -> Iterator[GroupCounter]:
        self.bytes.clear()
        saved: list[tuple[Any, str, Any]] = []
        for target in (dist, dist.distributed_c10d):
            for name, spec in _CALLS.items():
                original = getattr(target, name, None)
                if original is None:  # an older torch without the new names
                    continue
                saved.append((target, name, original))
                setattr(target, name, self._wrap(original, *spec))
        try:
            yield self
        finally:
            for target, name, original in reversed(saved):
                setattr(target, name, original)

    def _wrap(self, fn: Callable[..., Any], kind: str, sized_by: str) -> Any:
        signature = inspect.signature(fn)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                bound = signature.bind(*args, **kwargs).arguments
                tensor = bound[sized_by]
                nbytes = tensor.numel() * tensor.element_size()
                self.bytes[self._reach(bound.get("group"))] += nbytes
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted


# -- the engines ----------------------------------------------------------------------------


class Trainer:
    name: str
    padded_numel: int | None = None

    def step(self, micro_batches: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def traffic(self, micro_batches: list[torch.Tensor]) -> dict[str, int]:
        raise NotImplementedError

    def state_bytes(self) -> int:
        """This rank's model-state bytes (parameters, gradients, optimizer state) after a step."""
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to release by default."""


class ZeroDPTrainer(Trainer):
    def __init__(self, name: str, model: nn.Module, gas: int, micro: int) -> None:
        shard, hpz = ZERODP_GROUPS[name]
        self.name = name
        self.shard, self.hpz = shard, hpz
        config = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
            "zero_optimization": {
                "stage": 3,
                "mics_shard_size": shard,
                "zero_hpz_partition_size": hpz,
                "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": 0,
                "stage3_max_reuse_distance": 0,
            },
        }
        self.engine, *_ = zerodp.initialize(model=model, config=config)
        self.padded_numel = sum(state.flat.padded_numel for state in self.engine.groups)

    def step(self, micro_batches: list[torch.Tensor]) -> None:
        for x in micro_batches:
            self.engine.backward(self.engine(x).square().mean())
            self.engine.step()

    def traffic(self, micro_batches: list[torch.Tensor]) -> dict[str, int]:
        self.engine.comm.stats.reset()
        self.step(micro_batches)
        found = self.engine.comms.traffic()  # by group label too: shard, replica, secondary
        return {WITHIN: 0, ACROSS: 0} | found

    def state_bytes(self) -> int:
        return self.engine.model_state_bytes().total

    def close(self) -> None:
        self.engine.destroy()


class FSDP2Trainer(Trainer):
    def __init__(self, name: str, model: nn.Module, node_size: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.name = name
        world = dist.get_world_size()
        if name == "hsdp":
            shape, names = (world // node_size, node_size), ("replicate", "shard")
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        else:
            mesh = init_device_mesh("cpu", (world,))
        for block in model:
            fully_shard(block, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        self.counter = GroupCounter(node_size)

    def step(self, micro_batches: list[torch.Tensor]) -> None:
        gas = len(micro_batches)
        for index, x in enumerate(micro_batches):
            if self.name == "hsdp":  # HSDP: all-reduce across replicas at the last one only
                self.model.set_requires_all_reduce(index == gas - 1)  # type: ignore[operator]
            (self.model(x).square().mean() / gas).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def traffic(self, micro_batches: list[torch.Tensor]) -> dict[str, int]:
        with self.counter.active():
            self.step(micro_batches)
        return {WITHIN: self.counter.bytes[WITHIN], ACROSS: self.counter.bytes[ACROSS]}

    def state_bytes(self) -> int:
        return sharded_model_state_bytes(self.model, self.optimizer).total


def build(name: str, model: nn.Module, gas: int, micro: int, node_size: int) -> Trainer:
    if name.startswith("zerodp"):
        return ZeroDPTrainer(name, model, gas, micro)
    return FSDP2Trainer(name, model, node_size)


# -- measuring --------------------------------------------------------------------------------


def timed_steps(trainer: Trainer, data: list[list[torch.Tensor]]) -> float:
    """Seconds per step on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    for micro_batches in data:
        trainer.step(micro_batches)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item()) / max(1, len(data))


def formula_across(trainer: Trainer, gas: int, node_size: int) -> int | None:
    if not isinstance(trainer, ZeroDPTrainer) or trainer.padded_numel is None:
        return None
    expected = stage3_step_bytes(
        numel=trainer.padded_numel,
        element_size=4,
        micro_batches=gas,
        world_size=dist.get_world_size(),
        shard_size=trainer.shard,
        secondary_size=trainer.hpz,
    )
    return expected.across_nodes(node_size)


def measure(args: argparse.Namespace, node_size: int) -> list[dict[str, Any]]:
    rank = dist.get_rank()
    rows = []
    base = make_model(args.dim, args.layers)
    for gas in args.gas:
        data = batches(rank, gas, args.micro_batch, args.dim, 2 + args.steps)
        for name in args.engines:
            trainer = build(name, copy.deepcopy(base), gas, args.micro_batch, node_size)
            trainer.step(data[0])  # warm-up
            traffic = trainer.traffic(data[1])
            seconds = timed_steps(trainer, data[2:]) if args.steps else None
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, traffic)
            rows.append(
                {
                    "engine": name,
                    "gas": gas,
                    "per_rank": per_rank,
                    "formula_across": formula_across(trainer, gas, node_size),
                    "state_bytes": trainer.state_bytes(),
                    "step_s": seconds,
                }
            )
            trainer.close()
    return rows


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace, node_size: int) -> None:
    world = dist.get_world_size()
    params = args.layers * (args.dim * args.dim + args.dim)
    print(
        f"# {world} ranks as {world // node_size} nodes of {node_size}; MLP of {params:,} "
        f"parameters (fp32, {params * 4 / _MB:.2f} MB); stage 3, prefetch off; bytes per step "
        "as zerodp counts them (each collective's full tensor), per rank: within a node / "
        "across nodes"
    )
    heads = [f"rank {r} within / across (MB)" for r in range(world)]
    header = ["engine", "gas", *heads, "rank 0 by group (MB)", "formula across (MB)"]
    header += ["across vs flat", "model state, rank 0 (MB)"]
    if args.steps:
        header.append("step (s)")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    flat: dict[int, int] = {}
    for row in rows:
        mine = row["per_rank"][0][ACROSS]
        if row["engine"] == "zerodp_flat":
            flat[row["gas"]] = mine
        cells = [row["engine"], str(row["gas"])]
        cells += [f"{t[WITHIN] / _MB:.3f} / {t[ACROSS] / _MB:.3f}" for t in row["per_rank"]]
        groups = {k: v for k, v in row["per_rank"][0].items() if k not in (WITHIN, ACROSS)}
        cells.append(", ".join(f"{k} {v / _MB:.3f}" for k, v in groups.items()))
        formula = row["formula_across"]
        cells.append("" if formula is None else f"{formula / _MB:.3f}")
        base = flat.get(row["gas"])
        cells.append(f"{mine / base:.3f}" if base else "")
        cells.append(f"{row['state_bytes'] / _MB:.2f}")
        if args.steps:
            cells.append(f"{row['step_s']:.3f}")
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gas", default="1,4", help="micro-batches per step, a comma list")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=0, help="timed steps per engine (0: none)")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--node-size", type=int, default=0, help="ranks per node (0: from env)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    args.gas = [int(g) for g in args.gas.split(",")]
    args.engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engines {unknown}; choose from {list(ENGINES)}")
    if args.node_size:
        os.environ["ZERODP_NODE_SIZE"] = str(args.node_size)
    ensure_process_group()
    node_size = int(
        os.environ.get("ZERODP_NODE_SIZE")
        or os.environ.get("LOCAL_WORLD_SIZE")
        or dist.get_world_size()
    )
    rows = measure(args, node_size)
    if dist.get_rank() == 0:
        print_table(rows, args, node_size)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    destroy_process_group_if_owned()


if __name__ == "__main__":
    main()
