"""Time and size of one checkpoint save and one load of the benchmark model, per ZeRO stage.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/checkpoint_io.py

Each stage trains the small benchmark GPT for one step (so optimizer state
exists), saves a checkpoint (timed from a barrier to the end of the call on
every rank), then loads it into a fresh engine (timed likewise). Bytes are
the checkpoint directory's total size on disk.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zerodp
from examples.gpt import GPT, GPTConfig
from zerodp.comm import destroy_process_group_if_owned, ensure_process_group

SMALL = GPTConfig(vocab_size=8192, seq_len=128, n_layer=4, n_head=4, d_model=256)


def _engine(stage: int, dtype: str) -> tuple[zerodp.ZeroEngine, GPT]:
    torch.manual_seed(0)
    model = GPT(SMALL)
    config: dict = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10_000},
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    return engine, model


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def measure(stage: int, dtype: str, root: Path) -> tuple[float, float, int]:
    engine, model = _engine(stage, dtype)
    tokens = torch.randint(0, SMALL.vocab_size, (8, SMALL.seq_len + 1))
    engine.backward(model.loss(tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    directory = root / f"stage{stage}"
    save_s = _timed(lambda: engine.save_checkpoint(directory, tag="bench"))
    engine.destroy()
    engine, model = _engine(stage, dtype)
    load_s = _timed(lambda: engine.load_checkpoint(directory))
    engine.destroy()
    size = sum(f.stat().st_size for f in (directory / "bench").rglob("*") if f.is_file())
    return save_s, load_s, size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    ensure_process_group()
    rank = dist.get_rank()
    root = Path(args.dir or tempfile.gettempdir()) / "zerodp-checkpoint-bench"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    params = GPT(SMALL).num_params()
    rows = [(stage, *measure(stage, args.dtype, root)) for stage in range(4)]
    if rank == 0:
        print(
            f"checkpoint save/load, small GPT ({params / 1e6:.2f}M params, {args.dtype}), "
            f"world size {dist.get_world_size()}, torch {torch.__version__}"
        )
        print(f"{'stage':>5}  {'save s':>7}  {'load s':>7}  {'MiB':>7}")
        for stage, save_s, load_s, size in rows:
            print(f"{stage:>5}  {save_s:7.2f}  {load_s:7.2f}  {size / 2**20:7.1f}")
        shutil.rmtree(root, ignore_errors=True)
    destroy_process_group_if_owned()
    return 0


if __name__ == "__main__":
    sys.exit(main())
