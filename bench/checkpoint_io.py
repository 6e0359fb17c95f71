"""Time and size of one checkpoint save and one load of the benchmark model, per ZeRO stage.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/checkpoint_io.py
    python bench/checkpoint_io.py --hash-speed

`--hash-speed` (one process, no checkpoint) hashes one in-memory buffer with
the checksum zerodp writes (XXH3, 64 bits) and with zlib's CRC32, and prints
each one's throughput on one core: the reason checksums use XXH3.

Each stage trains the small benchmark GPT for one step (so optimizer state
exists), then, in each repeat, saves a checkpoint with checksums and one
without computing them (the baseline), and loads it into a second engine
with verification and without (`verify_checksums=False`), each timed from
a barrier to the end of the call on every rank. The ratios (`save x`,
`load x`: of the medians; `min x`: of the fastest repeats, the steadier on
a busy machine) are the cost of checksumming and verifying. Bytes are the
checkpoint directory's total size on disk.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
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
from zerodp.checkpoint_io import checksums
from zerodp.checkpoint_io.safe_metadata import read_metadata
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


@contextlib.contextmanager
def _no_hashing():
    """Saves that skip computing checksums (the files are not read back): the baseline."""
    originals = checksums.data_file_entry, checksums.small_file_entry
    checksums.data_file_entry = lambda file, chunks: {"size": 0, "chunks": []}
    checksums.small_file_entry = lambda file: {"size": 0, "hash": 0}
    try:
        yield
    finally:
        checksums.data_file_entry, checksums.small_file_entry = originals


def _verify_only(checkpoint: Path) -> None:
    """The checksum pass of a load alone: this rank's share of the data files, hashed."""
    files = checksums.read_manifest(checkpoint)
    if files is None:
        raise RuntimeError(f"{checkpoint} has no checksums")
    chunks = checksums.chunks_by_file(read_metadata(checkpoint))
    for name in checksums.my_share(chunks, dist.get_rank(), dist.get_world_size()):
        checksums.check_data_file(checkpoint, name, chunks[name], files)


def hash_speeds(mib: int, repeats: int) -> dict[str, float]:
    """Bytes per second of XXH3-64 (as `checksums` computes it) and of CRC32, on one core.

    The median of `repeats` passes over one buffer of random bytes, the two taking
    turns, so that a busy machine slows both alike.
    """
    import zlib

    import xxhash

    buffer = torch.randint(0, 256, (mib * 2**20,), dtype=torch.uint8).numpy().tobytes()
    hashers = {"xxh3_64": xxhash.xxh3_64_intdigest, "crc32": zlib.crc32}
    seconds: dict[str, list[float]] = {name: [] for name in hashers}
    for _ in range(repeats):
        for name, hasher in hashers.items():
            start = time.perf_counter()
            hasher(buffer)
            seconds[name].append(time.perf_counter() - start)
    return {name: len(buffer) / statistics.median(times) for name, times in seconds.items()}


def measure(stage: int, dtype: str, root: Path, repeats: int) -> dict[str, float]:
    """Median seconds of: save with checksums, save without, load verified, load unverified;
    the four are interleaved in each repeat, so machine noise hits them alike."""
    engine, model = _engine(stage, dtype)
    tokens = torch.randint(0, SMALL.vocab_size, (8, SMALL.seq_len + 1))
    engine.backward(model.loss(tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    directory = root / f"stage{stage}"
    loader, _ = _engine(stage, dtype)
    kinds = ("save", "save_plain", "load", "load_plain", "verify")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(repeats):
        times["save"].append(_timed(lambda: engine.save_checkpoint(directory, tag="bench")))
        with _no_hashing():
            times["save_plain"].append(
                _timed(lambda: engine.save_checkpoint(directory, tag="plain"))
            )
        times["load"].append(_timed(lambda: loader.load_checkpoint(directory, tag="bench")))
        times["load_plain"].append(
            _timed(lambda: loader.load_checkpoint(directory, tag="bench", verify_checksums=False))
        )
        times["verify"].append(_timed(lambda: _verify_only(directory / "bench")))
    engine.destroy()
    loader.destroy()
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update({f"{k}_min": min(v) for k, v in times.items()})
    out["bytes"] = sum(f.stat().st_size for f in (directory / "bench").rglob("*") if f.is_file())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats per stage")
    parser.add_argument(
        "--hash-speed", action="store_true", help="only the checksum's throughput on one core"
    )
    parser.add_argument("--hash-mib", type=int, default=256, help="--hash-speed: buffer MiB")
    args = parser.parse_args()
    if args.hash_speed:
        speeds = hash_speeds(args.hash_mib, args.repeats)
        print(
            f"one core, {args.hash_mib} MiB in memory, median of {args.repeats} passes: "
            + ", ".join(f"{name} {rate / 1e9:.1f} GB/s" for name, rate in speeds.items())
        )
        return 0
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    ensure_process_group()
    rank = dist.get_rank()
    root = Path(args.dir or tempfile.gettempdir()) / "zerodp-checkpoint-bench"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    params = GPT(SMALL).num_params()
    rows = [(stage, measure(stage, args.dtype, root, args.repeats)) for stage in range(4)]
    if rank == 0:
        print(
            f"checkpoint save/load, small GPT ({params / 1e6:.2f}M params, {args.dtype}), "
            f"world size {dist.get_world_size()}, torch {torch.__version__}, median of "
            f"{args.repeats} interleaved repeats"
        )
        print(
            f"{'stage':>5}  {'save s':>7}  {'no-hash s':>9}  {'save x':>6}  {'min x':>6}  "
            f"{'load s':>7}  {'no-verify s':>11}  {'load x':>6}  {'min x':>6}  "
            f"{'verify s':>8}  {'verify %':>8}  {'MiB':>6}"
        )
        for stage, m in rows:
            print(
                f"{stage:>5}  {m['save']:7.3f}  {m['save_plain']:9.3f}  "
                f"{m['save'] / m['save_plain']:6.3f}  "
                f"{m['save_min'] / m['save_plain_min']:6.3f}  {m['load']:7.3f}  "
                f"{m['load_plain']:11.3f}  {m['load'] / m['load_plain']:6.3f}  "
                f"{m['load_min'] / m['load_plain_min']:6.3f}  {m['verify']:8.3f}  "
                f"{100 * m['verify'] / m['load_plain']:7.1f}%  {m['bytes'] / 2**20:6.1f}"
            )
        print(
            "x: with checksums / without, medians; min x: the same for the fastest repeats; "
            "verify s: the checksum pass alone (each rank its share); verify %: of an "
            "unverified load"
        )
        shutil.rmtree(root, ignore_errors=True)
    destroy_process_group_if_owned()
    return 0


if __name__ == "__main__":
    sys.exit(main())
