"""Five backward patterns on DDP, FSDP2, DeepSpeed ZeRO 1-3 and zerodp 1-3, against a reference.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python bench/backward_patterns.py [--engines ...]

This backs the table "What each pattern does" in docs/backward-lifecycle.md. Each cell trains
a fresh copy of one seeded tiny model (three modules, each its own FSDP2 unit) on 2 ranks
(gloo, CPU, fp32, plain SGD lr 0.1 everywhere) and compares it with a reference computed in
the same run: a plain model copy per rank, each backward's gradients averaged with an explicit
`dist.all_reduce` and summed until `zero_grad()` (PyTorch's rule). Compared: the gradients
each engine exposes after the pattern (DeepSpeed and zerodp `safe_get_full_grad`, FSDP2
`full_tensor()`, DDP `.grad`), then the weights after one step (`safe_get_full_fp32_param`,
`full_tensor()`, the parameter); for `grad_of_params`, what `autograd.grad` returns against
the reference's local gradients. A cell reads "exact" (max abs diff <= 1e-6 on every rank),
"differs" (the first quantity off, and which wrong rule of `RULES` it matches exactly, if
any) or "raises" (type, message, the line). BACKWARD_PATTERNS_TRACEBACKS=1 prints tracebacks.

Run with plain `python`, the script is a driver: one `torchrun --nproc_per_node 2` per engine
(a fresh process group each), with a time limit; if a run dies or hangs, its current cell
says so and the engine's other patterns run in a new process. Under torchrun it runs what it
is given and prints those rows:

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 \\
        bench/backward_patterns.py --engines deepspeed3 --patterns retain_zero_grad
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from zerodp.testing import ReferenceDP  # noqa: E402

STAGES = (1, 2, 3)
ENGINES = (
    "ddp",
    "fsdp2",
    "fsdp2_noreshard",
    *(f"{e}{s}" for e in ("deepspeed", "zerodp") for s in STAGES),
)
LR, TOLERANCE, MICRO_BATCH = 0.1, 1e-6, 4
# Wrong rules, computed like the reference, that name what a differing engine did instead.
RULES = {
    "replace": "matches: each backward replaces the gradients kept so far",
    "local_after_first": "matches: the second backward is not reduced (this rank's own)",
}
Tensors = dict[str, torch.Tensor | None]


class Net(nn.Module):
    """Three modules; with `ckpt` the middle one is recomputed in backward (non-reentrant)."""

    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.mid = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.out = nn.Linear(8, 4)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = checkpoint(self.mid, h, use_reentrant=False) if self.ckpt else self.mid(h)
        return self.out(h)


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A plain copy; a DTensor (FSDP2) is gathered first."""
    if t is None:
        return None
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


# -- trainers: each engine through its own documented calls ------------------------------------


class Trainer:
    """DDP and FSDP2: `loss.backward()`, `optimizer.zero_grad()`, `optimizer.step()`, `.grad`."""

    def __init__(self, model: Any, module: nn.Module, optimizer: Any = None) -> None:
        self.model, self.module = model, module  # what forward calls; whose parameters
        self.optimizer = optimizer or torch.optim.SGD(module.parameters(), lr=LR)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        loss.backward(retain_graph=retain_graph)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        self.optimizer.step()

    def grads(self) -> Tensors:
        return {n: full(p.grad) for n, p in self.module.named_parameters()}

    def weights(self) -> Tensors:
        return {n: full(p) for n, p in self.module.named_parameters()}

    def close(self) -> None:
        """Nothing to release for torch's own wrappers."""


class Reference(Trainer):
    """The data-parallel reference every parity test compares with (`ReferenceDP`: each
    backward's gradients averaged by an explicit all_reduce and summed until `zero_grad()`).
    Another `rule` (`RULES`) computes a wrong answer on purpose, to name what an engine did."""

    def __init__(self, model: nn.Module, rule: str = "sum") -> None:
        self.dp = ReferenceDP(model, lambda params: torch.optim.SGD(params, lr=LR))
        super().__init__(model, model, self.dp.optimizer)
        self.rule, self.backwards = rule, 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self.backwards += 1
        if self.rule == "replace":
            self.dp.zero_grad()
        if self.rule == "local_after_first" and self.backwards > 1:
            loss.backward(retain_graph=retain_graph)  # this rank's own, added unreduced
            for param in self.model.parameters():
                if param.grad is not None:
                    self.dp.grad(param).add_(param.grad)
                    param.grad = None
            return
        self.dp.run_backward(lambda: loss.backward(retain_graph=retain_graph))

    def zero_grad(self) -> None:
        self.dp.zero_grad()

    def step(self) -> None:
        self.dp.step()

    def grads(self) -> Tensors:
        return {n: self.dp.grad(p).clone() for n, p in self.model.named_parameters()}


class ZeroTrainer(Trainer):
    """DeepSpeed or zerodp: `engine.backward/zero_grad/step` and the `safe_get_full_*` accessors."""

    def __init__(self, engine: Any, utils: Any) -> None:
        super().__init__(engine, engine.module, engine.optimizer)
        self.utils = utils

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self.model.backward(loss, retain_graph=retain_graph)

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def step(self) -> None:
        self.model.step()

    def grads(self) -> Tensors:
        get = self.utils.safe_get_full_grad
        return {n: full(get(p)) for n, p in self.module.named_parameters()}

    def weights(self) -> Tensors:
        get = self.utils.safe_get_full_fp32_param
        return {n: full(get(p)) for n, p in self.module.named_parameters()}

    def close(self) -> None:
        self.model.destroy()


def build(engine: str, model: Net) -> Trainer:
    if engine == "ddp":
        return Trainer(nn.parallel.DistributedDataParallel(model), model)
    if engine.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        keep = engine == "fsdp2_noreshard"  # not the default: weights kept gathered to backward
        for module in (model.inp, model.mid, model.out, model):
            fully_shard(module, mesh=mesh, reshard_after_forward=not keep)
        return Trainer(model, model)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": int(engine[-1]), "stage3_param_persistence_threshold": 0},
    }
    if engine.startswith("deepspeed"):
        import deepspeed
        import deepspeed.utils

        from bench._deepspeed import _skip_shm_op_build

        _skip_shm_op_build()
        config |= {"zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
        sgd = torch.optim.SGD(model.parameters(), lr=LR)
        engine_, *_ = deepspeed.initialize(model=model, optimizer=sgd, config=config)
        return ZeroTrainer(engine_, deepspeed.utils)
    import zerodp
    import zerodp.utils

    config["optimizer"] = {"type": "SGD", "params": {"lr": LR}}
    return ZeroTrainer(zerodp.initialize(model=model, config=config)[0], zerodp.utils)


# -- the patterns: each returns what autograd.grad gave, or None (then: grads, step, weights) ---


def retain_zero_grad(t: Trainer, x: torch.Tensor) -> Tensors | None:
    """One forward; backward(loss1, retain_graph=True); zero_grad(); backward(loss2)."""
    out = t.forward(x)
    t.backward(out.square().mean(), retain_graph=True)
    t.zero_grad()
    t.backward(out.abs().mean())
    return None


def accumulate(t: Trainer, x: torch.Tensor) -> Tensors | None:
    """Two backward passes without zero_grad, at a boundary: the gradients add up."""
    out = t.forward(x)
    t.backward(out.square().mean(), retain_graph=True)
    t.backward(out.abs().mean())
    return None


def gradient_penalty(t: Trainer, x: torch.Tensor) -> Tensors | None:
    """g = autograd.grad(loss, inputs, create_graph=True); backward(loss + |g|^2)."""
    x = x.clone().requires_grad_(True)
    loss = t.forward(x).square().mean()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    t.backward(loss + g.square().sum())
    return None


def grad_of_params(t: Trainer, x: torch.Tensor) -> Tensors | None:
    """autograd.grad(loss, params): this rank's local gradients, nothing reduced."""
    named = list(t.module.named_parameters())
    loss = t.forward(x).square().mean()
    grads = torch.autograd.grad(loss, [p for _, p in named])
    return {name: full(g) for (name, _), g in zip(named, grads, strict=True)}


def activation_checkpoint(t: Trainer, x: torch.Tensor) -> Tensors | None:
    """torch.utils.checkpoint(use_reentrant=False) around the middle module (`Net.ckpt`)."""
    t.backward(t.forward(x).square().mean())
    return None


RUN: dict[str, Callable[[Trainer, torch.Tensor], Tensors | None]] = {
    "retain_zero_grad": retain_zero_grad,
    "accumulate": accumulate,
    "gradient_penalty": gradient_penalty,
    "grad_of_params": grad_of_params,
    "checkpoint": activation_checkpoint,
}
PATTERNS = tuple(RUN)


def execute(pattern: str, t: Trainer) -> list[tuple[str, Tensors]]:
    """Run the pattern on this rank's batch; the quantities to compare, in order."""
    x = torch.randn(MICRO_BATCH, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    returned = RUN[pattern](t, x)
    if returned is not None:
        return [("autograd.grad", returned)]
    grads = t.grads()
    t.step()
    return [("grad", grads), ("weight", t.weights())]


def where_raised(exc: Exception) -> str:
    """The line of this script's pattern (or `execute`, `build`) that the exception came from."""
    names = {*(f.__name__ for f in RUN.values()), "execute", "build"}
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.name in names]
    return f"`{frames[-1].line}` in {frames[-1].name}" if frames else "?"


def verdict(
    got: list[tuple[str, Tensors]], want: list[tuple[str, Tensors]]
) -> tuple[int, float, str]:
    """(0 exact or 1 differs, max abs diff, text); the first quantity off decides."""
    worst = 0.0
    for (phase, values), (_, expected) in zip(got, want, strict=True):
        diff, where = 0.0, ""
        for name, ref in expected.items():
            value = values.get(name)
            if value is None or ref is None or value.shape != ref.shape:
                shape = None if value is None else tuple(value.shape)
                return 1, float("inf"), f"differs ({phase} of {name} is {shape})"
            if (d := (value - ref).abs().max().item()) > diff:
                diff, where = d, name
        if diff > TOLERANCE:
            return 1, diff, f"differs ({phase} max abs diff {diff:.1e} at {where})"
        worst = max(worst, diff)
    return 0, worst, "exact"


def run_cell(engine: str, pattern: str) -> str:
    """One engine on one pattern against the reference; every rank's verdict merged."""
    if engine.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        return "not run: DeepSpeed is not installed (pip install -e '.[bench]')"
    torch.manual_seed(0)
    base = Net(ckpt=pattern == "checkpoint")
    want = execute(pattern, Reference(copy.deepcopy(base)))
    wrong = {rule: execute(pattern, Reference(copy.deepcopy(base), rule)) for rule in RULES}
    trainer: Trainer | None = None
    try:
        trainer = build(engine, copy.deepcopy(base))
        got = execute(pattern, trainer)
        local = (*verdict(got, want), [r for r, w in wrong.items() if not verdict(got, w)[0]])
    except Exception as exc:  # the cell's finding, not the script's failure
        if os.environ.get("BACKWARD_PATTERNS_TRACEBACKS") and dist.get_rank() == 0:
            traceback.print_exc()
        line = (str(exc).strip().splitlines() or [""])[0][:160]
        local = (2, 0.0, f"raises {type(exc).__name__}: {line} (at {where_raised(exc)})", [])
    finally:
        with contextlib.suppress(Exception):  # a failed engine may not close cleanly
            if trainer is not None:
                trainer.close()
    verdicts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, local)
    severity, _, text, _ = max(verdicts, key=lambda v: (v[0], v[1]))
    matched = set.intersection(*(set(v[3]) for v in verdicts))  # on every rank
    return "; ".join([text, *(RULES[r] for r in RULES if r in matched)]) if severity else text


# -- entry points: the worker (under torchrun) and the driver (plain python) -------------------


def print_table(rows: list[dict[str, str]]) -> None:
    try:
        ds = version("deepspeed")
    except PackageNotFoundError:
        ds = "not installed"
    print(f"torch {torch.__version__}, DeepSpeed {ds}; 2 ranks, gloo, CPU, fp32, SGD lr {LR}")
    print("| pattern | engine | result |\n|---|---|---|")
    order = {name: i for i, name in enumerate((*PATTERNS, *ENGINES))}
    for row in sorted(rows, key=lambda r: (order[r["pattern"]], order[r["engine"]])):
        print(f"| {row['pattern']} | {row['engine']} | {row['result']} |", flush=True)


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    rows = []
    for engine in args.engines:
        for pattern in args.patterns:
            rows.append({"engine": engine, "pattern": pattern, "result": run_cell(engine, pattern)})
            if dist.get_rank() == 0 and args.results:
                with open(args.results, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    if dist.get_rank() == 0:
        print_table(rows)
    dist.destroy_process_group()


def driver(args: argparse.Namespace) -> None:
    """One torchrun per engine; a run that dies or hangs costs only the cell it was in."""
    rows: list[dict[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp, "run.log")
        for engine in args.engines:
            remaining = list(args.patterns)
            while remaining:
                results = Path(tmp, f"cells{len(rows)}.jsonl")  # new each run: rows grows
                print(f"{engine}: {', '.join(remaining)}", file=sys.stderr, flush=True)
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
                command += ["--nproc_per_node", "2", __file__, "--engines", engine]
                command += ["--patterns", ",".join(remaining), "--results", str(results)]
                with open(log, "w") as out:
                    run = subprocess.Popen(command, stdout=out, stderr=out)
                    try:
                        failure = f"the run ended with exit code {run.wait(args.timeout)}"
                    except subprocess.TimeoutExpired:
                        run.terminate()  # torchrun stops its workers (each in its own session)
                        run.wait()
                        failure = f"hangs (no result in {args.timeout} s)"
                text = results.read_text() if results.exists() else ""
                done = [json.loads(line) for line in text.splitlines()]
                rows += done
                remaining = remaining[len(done) :]
                if remaining:  # the cell the run was in when it ended
                    print(log.read_text()[-3000:], file=sys.stderr)
                    rows.append({"engine": engine, "pattern": remaining.pop(0), "result": failure})
    print_table(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default=",".join(ENGINES), type=lambda s: s.split(","))
    p.add_argument("--patterns", default=",".join(PATTERNS), type=lambda s: s.split(","))
    p.add_argument("--timeout", type=int, default=300, help="driver: seconds per torchrun")
    p.add_argument("--collective-timeout", type=int, default=120, help="gloo timeout, seconds")
    p.add_argument("--results", default="", help="worker: append one JSON line per cell")
    args = p.parse_args()
    unknown = set(args.engines) - set(ENGINES) | set(args.patterns) - set(PATTERNS)
    if unknown:
        p.error(f"unknown {sorted(unknown)}; engines {ENGINES}, patterns {PATTERNS}")
    (worker if "LOCAL_RANK" in os.environ else driver)(args)


if __name__ == "__main__":
    main()
