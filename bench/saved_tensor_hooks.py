"""Stage 3's saved-tensor hooks where zerodp installs them, against around the whole forward.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/saved_tensor_hooks.py

zerodp installs its saved-tensor hooks only while a module holding sharded groups runs
([Note: saving windows] in zerodp/stage3/saved_tensors.py). Around the whole forward, the
placement before, every tensor the forward saves costs a Python call. This times both on
the same engine, interleaved, step by step: "whole forward" pushes the engine's own hooks
around each forward, so the scopes inside find them active and step aside (exactly the
earlier placement); "scopes" is the default; the two alternate which runs first. It counts, for
one step of each, the tensors packed through the hooks and those recognised as a sharded
parameter's storage (which must be equal in both: the scopes miss no parameter).

The model is step_time.py's narrow GPT (48 blocks of d_model 32); each persistence
threshold decides which blocks hold sharded groups: at 0 every block does, at 10,000 only
the tied embedding and output layer do, at 100,000 (zerodp's default) nothing does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import zerodp  # noqa: E402
from bench._measure import timed  # noqa: E402
from bench.step_time import MODELS  # noqa: E402
from examples.gpt import GPT  # noqa: E402
from zerodp.comm import default_device, destroy_process_group_if_owned, ensure_process_group  # noqa: E402
from zerodp.stage3.saved_tensors import SavedParameterView, SavedTensorGatherer  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--thresholds", default="0,10000,100000", help="persistence thresholds")
    p.add_argument("--repeats", type=int, default=9, help="interleaved repeats per threshold")
    p.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
    p.add_argument("--micro-batch", type=int, default=4)
    return p.parse_args(argv)


class Harness:
    """One narrow-GPT engine at `threshold`, stepped with the hooks in either placement."""

    def __init__(self, threshold: int, micro_batch: int, device: torch.device) -> None:
        cfg = MODELS["narrow"]
        torch.manual_seed(0)
        config = {
            "train_micro_batch_size_per_gpu": micro_batch,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold},
        }
        self.engine, *_ = zerodp.initialize(model=GPT(cfg).to(device), config=config)
        self.gatherer: SavedTensorGatherer = self.engine.params.saved_tensors
        gen = torch.Generator().manual_seed(dist.get_rank())
        self.tokens = torch.randint(cfg.vocab_size, (micro_batch, cfg.seq_len), generator=gen)
        self.tokens = self.tokens.to(device)
        self.vocab = cfg.vocab_size

    def step(self, whole_forward: bool) -> None:
        if whole_forward:
            with torch.autograd.graph.saved_tensors_hooks(self.gatherer.pack, self.gatherer.unpack):
                logits = self.engine(self.tokens)
        else:
            logits = self.engine(self.tokens)
        loss = F.cross_entropy(logits.reshape(-1, self.vocab), self.tokens.reshape(-1))
        self.engine.backward(loss)
        self.engine.step()

    def count(self, whole_forward: bool) -> tuple[int, int]:
        """(tensors packed, of which sharded parameters' storage) in one step."""
        counts = [0, 0]
        original = self.gatherer.pack

        def counting(tensor: torch.Tensor) -> Any:
            packed = original(tensor)
            counts[0] += 1
            counts[1] += isinstance(packed, SavedParameterView)
            return packed

        self.gatherer.pack = counting  # type: ignore[method-assign]
        try:
            self.step(whole_forward)
        finally:
            del self.gatherer.pack
        return counts[0], counts[1]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ensure_process_group()
    device = default_device()
    rows = []
    for threshold in (int(t) for t in args.thresholds.split(",")):
        harness = Harness(threshold, args.micro_batch, device)
        for _ in range(2):  # warm-up: the first step records the order
            harness.step(whole_forward=False)
        whole_counts, scope_counts = harness.count(True), harness.count(False)
        times: dict[bool, list[float]] = {True: [], False: []}
        for repeat in range(args.repeats):
            for whole in (True, False) if repeat % 2 == 0 else (False, True):

                def run(whole: bool = whole, harness: Harness = harness) -> None:
                    for _ in range(args.steps):
                        harness.step(whole)

                times[whole].append(timed(run, device) / args.steps * 1e3)
        ratios = [s / w for s, w in zip(times[False], times[True], strict=True)]
        rows.append((threshold, whole_counts, scope_counts, times, statistics.median(ratios)))
        harness.engine.destroy()
    if dist.get_rank() == 0:
        print(
            f"narrow GPT, {dist.get_world_size()} ranks, micro-batch {args.micro_batch}, "
            f"{args.repeats} interleaved repeats of {args.steps} steps"
        )
        print(
            "threshold  packs/step whole  packs/step scopes  params whole  params scopes"
            "  ms whole  ms scopes  scopes/whole (paired median)"
        )
        for threshold, whole, scopes, times, ratio in rows:
            print(
                f"{threshold:>9}  {whole[0]:>16}  {scopes[0]:>17}  {whole[1]:>12}  "
                f"{scopes[1]:>13}  {statistics.median(times[True]):>8.1f}  "
                f"{statistics.median(times[False]):>9.1f}  {ratio:>28.3f}"
            )
    destroy_process_group_if_owned()


if __name__ == "__main__":
    main()
