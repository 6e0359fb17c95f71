"""Memory by phase of a few steps on scaling.py's memory-cap GPT: zerodp or FSDP2.

    MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=1 \
        torchrun --standalone --nproc_per_node 2 bench/fit_phases.py --engine zerodp3 --layers 24

The memory-cap search (scaling.py `fit`) says only whether a depth fits; this says where
the memory goes, on rank 0, in MiB over its figures before the model was built, after each
forward, backward and step (with `zero_grad` for FSDP2): `VmData` at the phase's end (what
RLIMIT_DATA caps); `VmPeak` growth (the virtual high-water mark, which only rises: the
phase in which it rises set it); the phase's own resident peak (`VmHWM`, reset at each
phase's start); and what is held at the phase's end in parameter storage (zerodp: the
shards and the persistent groups' full buffers; FSDP2: the local shards), gradients (zerodp:
the kept gradients holding memory; FSDP2: the local `.grad` shards) and optimizer state.
`pool` is the most bytes of gradient buckets the zerodp reducer has held at once. Run it
uncapped with the search's malloc settings (above): with glibc's default, growing mmap
threshold, freed blocks stay in the heap and the figures move by tens of MiB between runs.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import step_time  # noqa: E402
from bench._engines import Runner, TorchRunner, TrainSettings, ZeroDPRunner, parse_engines  # noqa: E402
from bench.scaling import FIT_MODEL  # noqa: E402
from examples.gpt import GPTConfig  # noqa: E402
from zerodp.comm import default_device, destroy_process_group_if_owned, ensure_process_group  # noqa: E402

MiB = 1 << 20


def _vm_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_hwm() -> bool:
    """Reset VmHWM (peak resident memory) so the next reading is this phase's own peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _tensor_mib(tensors: Iterable[torch.Tensor]) -> float:
    """MiB of the distinct storages behind `tensors` (a released storage counts 0)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values()) / MiB


def _held(runner: Runner) -> dict[str, float]:
    """This rank's parameter, gradient and optimizer-state MiB held now (no collective)."""
    if isinstance(runner, ZeroDPRunner):
        states = runner.engine.groups.states
        params = [s.flat.shard for s in states] + [s.flat.full for s in states if s.flat.persistent]
        grads = [s.grads.storage for s in states if s.grads and not s.grads.released]
        optimizer = runner.engine.optimizer.inner
    else:
        assert isinstance(runner, TorchRunner)
        params = [p.to_local() if hasattr(p, "to_local") else p for p in runner.model.parameters()]
        grads = [
            g.to_local() if hasattr(g, "to_local") else g
            for g in (p.grad for p in runner.model.parameters())
            if g is not None
        ]
        optimizer = runner.optimizer
    state = [
        v.to_local() if hasattr(v, "to_local") else v
        for slots in optimizer.state.values()
        for v in slots.values()
        if torch.is_tensor(v)
    ]
    return {"params": _tensor_mib(params), "grads": _tensor_mib(grads), "optim": _tensor_mib(state)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", default="zerodp3", help="zerodp0..zerodp3, or fsdp2")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--persistence-threshold", type=int, default=10_000)
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    ensure_process_group()
    spec = parse_engines(args.engine)[0]
    if spec.engine not in ("zerodp", "fsdp2"):
        raise SystemExit(f"--engine must be a zerodp stage or fsdp2, got {args.engine}")
    settings = TrainSettings(
        micro_batch=args.micro_batch,
        lr=1e-4,
        reduce_bucket_size=2_000_000,  # as scaling.py's fit tasks
        persistence_threshold=args.persistence_threshold,
        prefetch_bucket_size=1_000_000,
    )
    device = default_device()
    data0, vpeak0, rss0 = _vm_mib("VmData"), _vm_mib("VmPeak"), _vm_mib("VmRSS")
    hwm = _reset_hwm()
    cfg = GPTConfig(**(FIT_MODEL | {"n_layer": args.layers}))
    model = step_time.build_model(cfg, 1234).to(device)
    batches = step_time.make_batches(cfg, args.micro_batch, args.steps, 1234, device)
    runner = step_time.build_runner(spec, model, settings, device)
    del model
    engine = runner.engine if isinstance(runner, ZeroDPRunner) else None
    lines = [
        f"{'phase':<18} {'VmData':>7} {'VmPeak':>7} {'peak RSS':>8} {'params':>7} "
        f"{'grads':>7} {'optim':>7} {'pool':>5}"
    ]

    def note(phase: str) -> None:
        peak = _vm_mib("VmHWM") - rss0 if hwm else float("nan")
        held = _held(runner)
        pool = engine.reducer.bucket_numel_held * 4 / MiB if engine is not None else float("nan")
        lines.append(
            f"{phase:<18} {_vm_mib('VmData') - data0:7.1f} {_vm_mib('VmPeak') - vpeak0:7.1f} "
            f"{peak:8.1f} {held['params']:7.1f} "
            f"{held['grads']:7.1f} {held['optim']:7.1f} {pool:5.1f}"
        )
        _reset_hwm()

    note("built")
    for step in range(args.steps):
        loss = engine(*batches[step]) if engine is not None else runner.model(*batches[step])
        note(f"step {step} forward")
        if engine is not None:
            engine.backward(loss)
        else:
            loss.backward()
        del loss
        note(f"step {step} backward")
        runner.optimizer_step()
        runner.zero_grad()
        note(f"step {step} step")
    if dist.get_rank() == 0:
        print(
            f"{args.engine}, {args.layers} layers, rank 0, MiB over the start (see the "
            "module's docstring)"
        )
        print("\n".join(lines), flush=True)
    dist.barrier()
    runner.close()
    destroy_process_group_if_owned()


if __name__ == "__main__":
    main()
