"""One attempt of bench/sequence_fit.py: two training steps on one sequence length, capped.

    (started by bench/sequence_fit.py through bench/_scaling_launch.launch, one process per rank)

The task names the engine ("zerodp" or "deepspeed"), S (`sequence_parallel_size`, the
world size: one sequence split over every rank), whether zerodp tiles (`tiled_compute`
with the MLPs and the logits and loss), the sequence length and the budget. Once the
process group is up and the model is built, RLIMIT_DATA (the process's private memory)
is set, after the engine is built and has trained one step on 8 x S tokens (so its
threads, optimizer state and buffers exist), to what the process holds then plus the
budget: what a longer sequence needs (activations, and the stage 3 gathers again) must
fit in it. Two steps of ZeRO stage 3 with AdamW on one row of `length` tokens; any
failure is reported as not fitting, and the driver starts the next attempt in fresh
processes.

DeepSpeed 0.19.8 runs its Ulysses as bench/sequence_deepspeed.py does (its tutorial's
attention switch, the row split as its data-loader adapter does, the loss parts summed
with a differentiable all-reduce), untiled; with S = 1, plain ZeRO stage 3.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench._deepspeed import ulysses_slice_loss  # noqa: E402
from bench._fit_probe import record_misfit, vm_kib  # noqa: E402


def build_model(model: dict[str, int], length: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=model["vocab"],
        hidden_size=model["hidden"],
        intermediate_size=model["intermediate"],
        num_hidden_layers=model["layers"],
        num_attention_heads=model["heads"],
        num_key_value_heads=model["heads"],
        max_position_embeddings=max(length, 16),
        tie_word_embeddings=False,
    )
    llama = LlamaForCausalLM(config)
    llama.set_attn_implementation("sdpa")
    return llama


def row(task: dict[str, Any], step: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    return torch.randint(3, task["model"]["vocab"], (1, length), generator=generator)


def zerodp_engine(task: dict[str, Any], model: Any) -> Callable[[int, int], None]:
    import zerodp

    tiles = {"mlp": True, "logits_loss": True} if task["tiled"] else {}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "sequence_parallel_size": task["sequence"],
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "tiled_compute": tiles,
        "steps_per_print": 1000,
    }
    engine, _, _, _ = zerodp.initialize(model=model, config=config)

    def train(step: int, length: int) -> None:
        ids = row(task, step, length)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()

    return train


def deepspeed_engine(task: dict[str, Any], model: Any) -> Callable[[int, int], None]:
    import deepspeed

    size = task["sequence"]
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "sequence_parallel_size": size,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    mpu = None
    if size > 1:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation="sdpa",
            sequence_parallel_size=size,
            micro_batch_size=1,
            seq_length=task["length"],
            seq_length_is_variable=True,
        )
    # torch's AdamW: DeepSpeed's own would JIT-build its fused CPU op (bench/_deepspeed.py).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    rank = dist.get_rank()

    def train(step: int, length: int) -> None:
        # The output is held through the backward, as the zerodp loop above holds its own.
        _held, loss, count = ulysses_slice_loss(engine, row(task, step, length), rank, size)
        if size > 1:  # the tutorial's token-weighted sum of the parts (its all_reduce form)
            total = torch.distributed.nn.functional.all_reduce(loss * count) / (length - 1)
        else:
            total = loss
        engine.backward(total)
        engine.step()

    return train


def attempt(task: dict[str, Any]) -> dict[str, Any]:
    """Build, one warm-up step on 8 x S tokens (threads, optimizer state, buffers), then the
    cap: what the process holds then plus the budget, for two steps of `length` tokens."""
    result: dict[str, Any] = {"rank": dist.get_rank()}
    model = build_model(task["model"], task["length"])
    before = vm_kib("VmData") * 1024
    build = deepspeed_engine if task["engine"] == "deepspeed" else zerodp_engine
    train = build(task, model)
    del model
    train(0, 8 * task["sequence"])
    baseline = vm_kib("VmData") * 1024
    result["engine_vmdata_bytes"] = baseline - before
    result["warm_vmhwm_bytes"] = vm_kib("VmHWM") * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (baseline + task["budget_bytes"],) * 2)
    try:
        for step in (1, 2):
            train(step, task["length"])
        result["ok"] = True
    except BaseException as exc:  # any failure under the cap means the length does not fit
        record_misfit(result, exc)
    result["vmhwm_bytes"] = vm_kib("VmHWM") * 1024
    return result


def main() -> None:
    task_path, out_path = sys.argv[1], sys.argv[2]
    task = json.loads(Path(task_path).read_text())
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    if task["engine"] == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        from bench._deepspeed import _skip_shm_op_build

        _skip_shm_op_build()
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    result = attempt(task)
    if result["ok"]:
        dist.barrier()
    Path(f"{out_path}.rank{dist.get_rank()}").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 3)  # a failed rank may have left a peer in a collective


if __name__ == "__main__":
    main()
