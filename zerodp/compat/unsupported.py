"""What of DeepSpeed's script surface zerodp does not implement, and what to use instead.

Each entry is one message, raised where a script first touches the feature:
importing the module (`zerodp.UnsupportedModuleError`, a ModuleNotFoundError)
or reading the name (`zerodp.UnsupportedFeatureError`, an AttributeError, so
`hasattr` stays False and feature probes take their fallback). docs/deepspeed.md
lists them.
"""

from __future__ import annotations

import dis
import importlib
import sys
from typing import Any, NoReturn

from zerodp.errors import UnsupportedFeatureError, UnsupportedModuleError

PIPE = (
    "pipeline parallelism (PipelineModule, PipelineEngine) is not in zerodp, which is data "
    "parallel only; train the whole model on every rank with zero_optimization.stage 3, "
    "which shards its parameters"
)
MOE = (
    "DeepSpeed's MoE layers (deepspeed.moe, expert parallelism) are not in zerodp; build the "
    "experts as ordinary modules and mark the MoE block with zerodp.zero.set_z3_leaf_modules "
    "(stage 3 gathers it whole, so ranks may route tokens to different experts)"
)
INFERENCE = (
    "DeepSpeed's inference engine and kernel injection (init_inference, module_inject) are "
    "not in zerodp; generate from a zerodp engine inside engine.gathered_for_generation() "
    "(docs/post-training.md), or serve the saved weights with an inference server"
)
KERNELS = (
    "DeepSpeed's custom kernels (deepspeed.ops.transformer, sparse attention, quantizers, op "
    "builders) are not in zerodp; use torch's modules (torch.nn.TransformerEncoderLayer, "
    "torch.nn.functional.scaled_dot_product_attention) and zerodp.ops' optimizers"
)
PARALLEL = (
    "DeepSpeed's AutoTP and Ulysses entry points (tp_model_init, set_autotp_mode, "
    "deepspeed.runtime.tensor_parallel, deepspeed.sequence.layer) are not zerodp's: zerodp "
    "splits the model at initialize from the config, "
    '"tensor_parallel": {"autotp_size": T} (docs/tensor-parallel.md) or '
    '"sequence_parallel_size": S (docs/sequence-parallel.md), and switches a Hugging Face '
    "model's attention itself (zerodp.sequence.sequence_parallel_attention for other models)"
)
HYBRID = (
    "DeepSpeed's hybrid engine is not in zerodp; a zerodp engine generates inside "
    "engine.gathered_for_generation() (docs/post-training.md)"
)
_FLOPS = "the flops profiler is not in zerodp; use torch.profiler or torch.utils.flop_counter"

# DeepSpeed module paths (below `deepspeed.`) -> the message; a path covers its submodules.
MODULES: dict[str, str] = {
    "pipe": PIPE,
    "runtime.pipe": PIPE,
    "moe": MOE,
    "inference": INFERENCE,
    "module_inject": INFERENCE,
    "model_implementations": INFERENCE,
    "runtime.hybrid_engine": HYBRID,
    "ops.transformer": KERNELS,
    "ops.sparse_attention": KERNELS,
    "ops.quantizer": KERNELS,
    "ops.fp_quantizer": KERNELS,
    "ops.op_builder": KERNELS,
    "ops.random_ltd": KERNELS,
    "ops.deepspeed4science": KERNELS,
    "ops.aio": (
        "DeepSpeed's async I/O op is not in zerodp; zerodp offloads to files itself "
        '(zero_optimization.offload_optimizer / offload_param with "device": "nvme")'
    ),
    "sequence.layer": PARALLEL,
    "runtime.tensor_parallel": PARALLEL,
    "compression": (
        "DeepSpeed Compression is not in zerodp; use torch.ao.quantization or a pruning library"
    ),
    "profiling": _FLOPS,
    "autotuning": "the autotuner is not in zerodp; bench/step_time.py measures step time",
    "linear": "DeepSpeed's LoRA and quantized linear layers are not in zerodp; use PEFT's LoRA",
    "elasticity": (
        "DeepSpeed's elastic batch sizes are not in zerodp; torchrun's elastic launch "
        "(zerodp run --nnodes MIN:MAX) restarts with the same config"
    ),
    "launcher": "use the zerodp command: zerodp run --num_gpus N script.py [args]",
    "env_report": "use the zerodp command: zerodp env",
    "nvme": (
        "DeepSpeed's NVMe tuning tools are not in zerodp; zerodp offloads to files with "
        '"device": "nvme" and nvme_path'
    ),
}

_RUNTIME = (
    "is DeepSpeed's internal module; zerodp has no counterpart (docs/deepspeed.md lists what "
    "zerodp provides)"
)

# Names read from a zerodp module that DeepSpeed's module of the same path has.
ATTRIBUTES: dict[str, dict[str, str]] = {
    "zerodp": {
        "PipelineModule": PIPE,
        "PipelineEngine": PIPE,
        "DualPipeVEngine": PIPE,
        "DualPipeVModule": PIPE,
        "LayerSpec": PIPE,
        "TiedLayerSpec": PIPE,
        "pipe": PIPE,
        "moe": MOE,
        "init_inference": INFERENCE,
        "InferenceEngine": INFERENCE,
        "DeepSpeedInferenceConfig": INFERENCE,
        "default_inference_config": INFERENCE,
        "inference": INFERENCE,
        "module_inject": INFERENCE,
        "replace_transformer_layer": INFERENCE,
        "revert_transformer_layer": INFERENCE,
        "DeepSpeedTransformerLayer": KERNELS,
        "DeepSpeedTransformerConfig": KERNELS,
        "DeepSpeedHybridEngine": HYBRID,
        "tp_model_init": PARALLEL,
        "set_autotp_mode": PARALLEL,
        "profiling": _FLOPS,
        "compression": MODULES["compression"],
        "autotuning": MODULES["autotuning"],
        "DeepSpeedConfig": (
            "zerodp validates the config itself: zerodp.config.load_config(config, "
            "world_size) returns a ZeroDPConfig"
        ),
        "OnDevice": (
            "OnDevice is not in zerodp; build the model under `with torch.device('meta'):`, "
            "or under zerodp.zero.Init() to create it sharded"
        ),
    },
    "zerodp.ops": {
        "DeepSpeedTransformerLayer": KERNELS,
        "DeepSpeedTransformerConfig": KERNELS,
        "transformer": KERNELS,
        "sparse_attention": KERNELS,
        "op_builder": KERNELS,
        "quantizer": KERNELS,
        "fp_quantizer": KERNELS,
    },
    "zerodp.runtime.lr_schedules": {
        "OneCycle": (
            "OneCycle is not in zerodp; pass lr_scheduler=lambda opt: "
            "torch.optim.lr_scheduler.OneCycleLR(opt, ...)"
        ),
        "LRRangeTest": (
            "LRRangeTest is not in zerodp; pass lr_scheduler=lambda opt: "
            "torch.optim.lr_scheduler.LambdaLR(opt, ...)"
        ),
    },
}


def module_message(path: str) -> str | None:
    """The message for DeepSpeed module `path` (below `deepspeed.`), if zerodp lacks it."""
    for prefix, message in MODULES.items():
        if path == prefix or path.startswith(prefix + "."):
            return message
    if path.startswith("runtime."):
        return f"deepspeed.{path} {_RUNTIME}"
    return None


def refuse_module(fullname: str, message: str) -> NoReturn:
    error = UnsupportedModuleError(f"{fullname}: {message}")
    error.name = fullname
    raise error


def missing_attribute(module_name: str, name: str) -> NoReturn:
    """For a module's `__getattr__`: the unsupported-feature error for `name`, or the usual one.

    Must be called by that `__getattr__` directly: `from zerodp import PipelineModule`
    turns any AttributeError into Python's bare "cannot import name", so when the
    name is being imported (the frame two levels up runs IMPORT_FROM) the error is
    an `UnsupportedModuleError` (an ImportError) that keeps the message.
    """
    message = ATTRIBUTES.get(module_name, {}).get(name)
    if message is None:
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    text = f"{module_name}.{name}: {message}"
    if _imported_by_name(sys._getframe(2)):
        refuse_module(f"{module_name}.{name}", message)
    raise UnsupportedFeatureError(text)


_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


def _imported_by_name(frame: Any) -> bool:
    """Whether `frame` is executing `from module import name` (CPython's bytecode)."""
    code = frame.f_code.co_code
    return 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] == _IMPORT_FROM


def resolve(target: str) -> Any:
    """`"package.module:attribute"` (or a module path) -> the object it names."""
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module
