"""Tokens per second of Hugging Face `generate` on a stage 3 model, by route, in one run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/generation.py \
        [--layers 6] [--hidden 256] [--vocab 8192] [--batch 4] [--prompt 16] \
        [--new-tokens 32] [--repeats 3] [--dtype fp32|bf16] [--json out.json]

Routes, each on its own copy of one random Llama (built from a config, no download),
timed interleaved (one repeat of every route in turn, `--repeats` times), greedy:

- `plain`: the model itself on every rank, no engine (the upper bound);
- `zerodp3`: a zerodp stage 3 inference engine, `model.generate` with no context (every
  forward gathers and releases through the module hooks);
- `zerodp3+gathered`: the same inside `engine.gathered_for_generation()`;
- `zerodp3+layers`: inside `engine.gathered_for_generation(layer_by_layer=True)`;
- `deepspeed3`, `deepspeed3+gathered`: a DeepSpeed ZeRO-3 engine without an optimizer,
  plain, and inside `deepspeed.zero.GatheredParameters(model.parameters())` (the route RL
  frameworks take); only when `import deepspeed` works (on CPU: DS_ACCELERATOR=cpu).

Columns: median and min tokens/s (new tokens over all ranks' batches, the slowest rank's
time), the ratio to `plain` (same run), the most parameter bytes gathered at once per rank
(zerodp's own count), and whether the tokens equal `plain`'s. Every row's tokens must be
equal: a route that generated different tokens is reported, never hidden.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import zerodp  # noqa: E402
from bench._deepspeed import _skip_shm_op_build, deepspeed_missing_reason  # noqa: E402
from bench._measure import median_min, timed  # noqa: E402
from zerodp.comm import default_device, destroy_process_group_if_owned, ensure_process_group  # noqa: E402


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.prompt + args.new_tokens,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    return LlamaForCausalLM(config)


class Route:
    """One way of generating: a model, and the context generate runs in."""

    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        context: Callable[[], contextlib.AbstractContextManager[Any]],
        peak: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.name, self.model, self.context, self.peak = name, model, context, peak
        self.samples: list[float] = []
        self.tokens: torch.Tensor | None = None


def _zerodp_routes(base: torch.nn.Module, dtype: str) -> tuple[list[Route], Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = zerodp.initialize(model=copy.deepcopy(base), config=config)
    gatherer = engine.params.gatherer
    reports: dict[str, Any] = {}

    def gathered(layer_by_layer: bool) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        @contextlib.contextmanager
        def context() -> Iterator[None]:
            with engine.gathered_for_generation(layer_by_layer=layer_by_layer) as report:
                yield
            reports[str(layer_by_layer)] = report.peak_gathered_bytes

        return context

    def hooks_peak() -> int:
        return gatherer.peak_live_numel * engine.precision.param_dtype.itemsize

    @contextlib.contextmanager
    def reset_peak() -> Iterator[None]:
        gatherer.reset_peak()
        yield

    routes = [
        Route("zerodp3", engine.module, reset_peak, hooks_peak),
        Route("zerodp3+gathered", engine.module, gathered(False), lambda: reports.get("False")),
        Route("zerodp3+layers", engine.module, gathered(True), lambda: reports.get("True")),
    ]
    return routes, engine


def _deepspeed_routes(base: torch.nn.Module, dtype: str) -> tuple[list[Route], str | None]:
    reason = deepspeed_missing_reason()
    if reason is not None:
        return [], f"DeepSpeed skipped: {reason}"
    import deepspeed

    _skip_shm_op_build()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=copy.deepcopy(base), config=config)
    module = engine.module
    routes = [
        Route("deepspeed3", module, contextlib.nullcontext),
        Route(
            "deepspeed3+gathered",
            module,
            lambda: deepspeed.zero.GatheredParameters(list(module.parameters())),
        ),
    ]
    return routes, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ensure_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = default_device()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    base = build_model(args)
    plain = copy.deepcopy(base).to(device)
    if args.dtype == "bf16":
        plain = plain.to(torch.bfloat16)
    routes = [Route("plain", plain, contextlib.nullcontext)]
    zerodp_routes, engine = _zerodp_routes(base, args.dtype)
    routes += zerodp_routes
    notes = []
    if not args.no_deepspeed:
        ds_routes, note = _deepspeed_routes(base, args.dtype)
        routes += ds_routes
        if note:
            notes.append(note)
    generator = torch.Generator().manual_seed(rank)
    prompts = torch.randint(3, args.vocab, (args.batch, args.prompt), generator=generator)
    prompts = prompts.to(device)

    def run(route: Route) -> None:
        with route.context(), torch.no_grad():
            route.tokens = route.model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=2,
            )

    for route in routes:  # warm-up (and DeepSpeed's first trace)
        run(route)
    for repeat in range(args.repeats):
        for route in routes:
            route.samples.append(timed(lambda r=route: run(r), device))
        if rank == 0:
            print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)

    new_tokens = args.batch * args.new_tokens * world
    rows = []
    reference = routes[0]
    for route in routes:
        median_s, min_s = median_min(route.samples)
        same = torch.equal(route.tokens, reference.tokens)  # type: ignore[arg-type]
        agreed = torch.tensor([int(same)], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        rows.append(
            {
                "route": route.name,
                "tokens_s_median": new_tokens / median_s,
                "tokens_s_max": new_tokens / min_s,
                "ratio_to_plain": reference.samples and median_min(reference.samples)[0] / median_s,
                "peak_gathered_bytes": route.peak(),
                "tokens_equal_plain": bool(agreed.item()),
            }
        )
    if rank == 0:
        params = sum(p.numel() for p in base.parameters())
        print(
            f"# generate: Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab} "
            f"({params / 1e6:.1f}M params, {args.dtype}), {world} ranks, batch {args.batch}/rank, "
            f"prompt {args.prompt}, {args.new_tokens} new tokens, greedy, {args.repeats} repeats"
        )
        header = ["route", "tokens/s (median)", "tokens/s (best)", "x plain"]
        header += ["peak gathered MiB", "tokens = plain"]
        print("| " + " | ".join(header) + " |")
        print("|---|---|---|---|---|---|")
        for row in rows:
            peak = row["peak_gathered_bytes"]
            shown = "-" if peak is None else f"{peak / 2**20:.2f}"
            print(
                f"| {row['route']} | {row['tokens_s_median']:.1f} | {row['tokens_s_max']:.1f} | "
                f"{row['ratio_to_plain']:.3f} | {shown} | {row['tokens_equal_plain']} |"
            )
        for note in notes:
            print(f"note: {note}")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    engine.destroy()
    destroy_process_group_if_owned()


if __name__ == "__main__":
    main()
