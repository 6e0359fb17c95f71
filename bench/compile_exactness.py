"""How far zerodp compiled with inductor is from eager zerodp, next to inductor's own distance.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/compile_exactness.py \
        [--stages 0,1,2,3] [--steps 10] [--backend inductor]

Inductor fuses and reorders floating-point work, so its results differ from eager ones in
the last bits; the question is whether zerodp adds anything to that. Each rank trains, from
one seed and on its own batches:

- `plain`: a plain single-process copy of the GPT (no engine, torch.optim.AdamW), eager
  and `torch.compile`d per block, the same way zerodp compiles at stage 3, and whole;
- `zerodp-S`: zerodp at stage S, eager and with its `compile` block (per block at stage 3,
  whole model at stages 0-2),

and prints the largest absolute difference of the losses over all steps and of the weights
after the last step (largest over ranks). zerodp's rows should be of the order of plain's
row with the same compile granularity (the weights also see ranks' gradients averaged,
which changes their size, not their kind). With `--backend aot_eager` every row is 0.
"""

from __future__ import annotations

import argparse
import copy
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
from examples.gpt import GPT, GPTConfig  # noqa: E402
from zerodp.comm import default_device, destroy_process_group_if_owned, ensure_process_group  # noqa: E402
from zerodp.zero import GatheredParameters  # noqa: E402

CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=64)
LR = 1e-3


def _loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def _batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    shape = (4, CFG.seq_len)
    return [torch.randint(0, CFG.vocab_size, shape, generator=gen) for _ in range(steps)]


def plain_run(
    base: GPT, batches: list[torch.Tensor], compiled: str, backend: str
) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = copy.deepcopy(base).to(default_device())
    if compiled == "blocks":
        for block in model.blocks:
            block.forward = torch.compile(block.forward, backend=backend)  # type: ignore[method-assign]
    elif compiled == "model":
        model.forward = torch.compile(model.forward, backend=backend)  # type: ignore[method-assign]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for tokens in batches:
        loss = _loss(model, tokens.to(default_device()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def zerodp_run(
    base: GPT, batches: list[torch.Tensor], stage: int, backend: str | None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if backend is not None:
        config["compile"] = {"enabled": True, "backend": backend}
    engine, _, _, _ = zerodp.initialize(model=copy.deepcopy(base), config=config)
    losses = []
    for tokens in batches:
        loss = _loss(engine, tokens.to(default_device()))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    params = dict(engine.module.named_parameters())
    with GatheredParameters(list(params.values())):
        weights = {n: p.detach().clone() for n, p in params.items()}
    engine.destroy()
    return losses, weights


def distance(a: tuple[list[float], dict[str, torch.Tensor]], b: Any) -> tuple[float, float]:
    loss = max(abs(x - y) for x, y in zip(a[0], b[0], strict=True))
    weight = max(float((a[1][n] - b[1][n]).abs().max()) for n in a[1])
    box = torch.tensor([loss, weight], dtype=torch.float64, device=default_device())
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box[0]), float(box[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--backend", default="inductor")
    args = p.parse_args(argv)
    ensure_process_group()
    torch.manual_seed(0)
    base = GPT(CFG)
    batches = _batches(args.steps)
    rows = []
    eager_plain = plain_run(base, batches, "", args.backend)
    for how in ("blocks", "model"):
        compiled = plain_run(base, batches, how, args.backend)
        rows.append((f"plain, {how}", *distance(eager_plain, compiled)))
    for stage in (int(s) for s in args.stages.split(",")):
        eager = zerodp_run(base, batches, stage, None)
        compiled = zerodp_run(base, batches, stage, args.backend)
        how = "blocks" if stage == 3 else "model"
        rows.append((f"zerodp-{stage}, {how}", *distance(eager, compiled)))
    if dist.get_rank() == 0:
        print(f"backend {args.backend}, {args.steps} steps, GPT {CFG.n_layer} layers, fp32")
        print("run                max |loss diff|  max |weight diff|")
        for name, loss, weight in rows:
            print(f"{name:18s} {loss:15.3e}  {weight:17.3e}")
    destroy_process_group_if_owned()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
