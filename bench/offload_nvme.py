"""NVMe offload: the I/O throughput it reaches against the disk's own, and a capped run.

    python bench/offload_nvme.py --nvme-path DIR [--params 200] [--steps 3]

1. The disk: `dd` writes and reads a file of the optimizer state's size on DIR with
   direct I/O (the page cache bypassed): the disk's own throughput.
2. The optimizer: an fp32 model of `--params` million parameters trains at world size
   1 with `offload_optimizer` on NVMe; each step reads every group's fp32 copy and
   Adam moments back from DIR and writes them out again (the pages are dropped after
   each group's write-back), so bytes moved per step are twice the state's size, and
   the throughput is that over the time the host step took.
3. The cap: a stage 3 run with its parameter shards and optimizer state on NVMe sets
   `RLIMIT_DATA` (the process's private memory) to what it uses once built, plus a
   small margin, and trains under it: its optimizer state, larger than the whole cap,
   is in shared file mappings that the OS pages in and out. The same run with the
   state in host memory (`device: "cpu"`), under the same cap, fails.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import zerodp  # noqa: E402
from zerodp.optim.offloaded_step import OffloadedSteps  # noqa: E402

MiB = 2**20


def _dd(path: Path, mib: int) -> tuple[float, float]:
    """Write then read `mib` MiB with direct I/O; (write MB/s, read MB/s) as dd reports them."""
    target = path / "zerodp-dd-probe"

    def run(args: list[str]) -> float:
        out = subprocess.run(args, capture_output=True, text=True, check=True).stderr
        match = re.search(r"([\d.,]+) ([kMG]?B)/s", out)
        if match is None:
            raise RuntimeError(f"cannot read dd's throughput from: {out}")
        value = float(match.group(1).replace(",", "."))
        return value * {"kB": 1e-3, "MB": 1.0, "GB": 1e3, "B": 1e-6}[match.group(2)]

    try:
        write = run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "oflag=direct"])
        read = run(["dd", f"if={target}", "of=/dev/null", "bs=1M", "iflag=direct"])
    finally:
        target.unlink(missing_ok=True)
    return write, read


def _model(millions: int) -> nn.Module:
    width = 2048
    layers = max(1, millions * 1_000_000 // (width * width))
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def _config(device: str, nvme: Path, stage: int = 2) -> dict:
    zero: dict = {
        "stage": stage,
        "reduce_bucket_size": 4_200_000,  # about one layer per group
        "offload_optimizer": {"device": device, "nvme_path": str(nvme)},
    }
    if stage == 3:
        zero["offload_param"] = {"device": device, "nvme_path": str(nvme)}
        zero["stage3_param_persistence_threshold"] = 0
        zero["stage3_prefetch_bucket_size"] = 4_200_000  # gather one layer ahead, not 50M
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
    }


def _vm_data() -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(r"VmData:\s+(\d+) kB", text)
    return int(match.group(1)) * 1024 if match else 0


def train(device: str, nvme: Path, millions: int, steps: int) -> dict:
    """Train at stage 2 with the optimizer offloaded to `device`; throughput of its I/O."""
    torch.manual_seed(0)
    model = _model(millions)
    params = sum(p.numel() for p in model.parameters())
    host_seconds = [0.0]
    original = OffloadedSteps.step

    def clocked(self: OffloadedSteps, inner: object, states: object) -> None:
        start = time.perf_counter()
        original(self, inner, states)  # type: ignore[arg-type]
        host_seconds[0] += time.perf_counter() - start

    OffloadedSteps.step = clocked  # type: ignore[method-assign]
    engine, _, _, _ = zerodp.initialize(model=model, config=_config(device, nvme))
    x = torch.randn(4, 2048)
    for step in range(steps):
        if step == 1:
            host_seconds[0] = 0.0  # the first step creates the state: not timed
        engine.backward(engine(x).square().mean())
        engine.step()
    engine.destroy()
    OffloadedSteps.step = original  # type: ignore[method-assign]
    state_bytes = 12 * params
    timed_steps = steps - 1
    return {
        "params": params,
        "state_bytes": state_bytes,
        "host_step_s": host_seconds[0] / max(1, timed_steps),
        "throughput_MBps": 2 * state_bytes * timed_steps / max(host_seconds[0], 1e-9) / 1e6,
    }


def capped(device: str, nvme: Path, millions: int, cap: int) -> dict:
    """Stage 3, shards and optimizer on `device`, under RLIMIT_DATA `cap` (0: set it here)."""
    if cap:
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    try:
        config = _config(device, nvme, stage=3)
        with zerodp.zero.Init(config=config):
            model = _model(millions)
        params = sum(p.numel() for p in model.parameters())
        engine, _, _, _ = zerodp.initialize(model=model, config=config)
        if not cap:
            cap = _vm_data() + 256 * MiB  # what it uses now, and a margin for the step
            resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
        x = torch.randn(4, 2048)
        for _ in range(2):
            engine.backward(engine(x).square().mean())
            engine.step()
    except (MemoryError, RuntimeError) as error:
        if not isinstance(error, MemoryError) and "allocate" not in str(error):
            raise
        return {"ok": False, "cap": cap, "error": str(error).splitlines()[0][:160]}
    return {"ok": True, "cap": cap, "params": params, "state_bytes": 12 * params}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nvme-path", default=None, help="default: a temporary directory")
    p.add_argument("--params", type=int, default=200, help="millions of parameters")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cap", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    nvme = Path(args.nvme_path or tempfile.mkdtemp(prefix="zerodp-nvme-"))
    nvme.mkdir(parents=True, exist_ok=True)
    if args.child is not None:  # one capped run, in a process of its own
        print(capped(args.child, nvme, args.params, args.cap or 0), flush=True)
        return
    state_mib = 12 * args.params
    write, read = _dd(nvme, state_mib)
    print(f"disk ({nvme}): dd direct I/O, {state_mib} MiB: write {write:.0f} MB/s, "
          f"read {read:.0f} MB/s")  # fmt: skip
    result = train("nvme", nvme, args.params, args.steps)
    print(
        f"NVMe offload, {result['params'] / 1e6:.1f}M params, optimizer state "
        f"{result['state_bytes'] / MiB:.0f} MiB: host step {result['host_step_s']:.2f} s, "
        f"read + write {result['throughput_MBps']:.0f} MB/s"
    )
    cap = 0
    for device in ("nvme", "cpu"):
        command = [
            sys.executable, __file__, "--nvme-path", str(nvme), "--params", str(args.params),
            "--child", device, "--cap", str(cap),
        ]  # fmt: skip
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}  # frees return memory
        out = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
        lines = out.stdout.strip().splitlines() or out.stderr.strip().splitlines()[-1:]
        report = lines[-1] if lines else "(no output)"
        print(f"stage 3 under RLIMIT_DATA, shards and optimizer state on {device}: {report}")
        match = re.search(r"'cap': (\d+)", report)
        if device == "nvme" and match:
            cap = int(match.group(1))
            state = 12 * args.params * 10**6
            print(f"  the cap is {cap / MiB:.0f} MiB; the optimizer state is {state / MiB:.0f} MiB")


if __name__ == "__main__":
    main()
