"""DeepSpeed features zerodp does not implement, and what to do instead.

A key here is an error unless its value leaves the feature off (`off`), for
example a block with `"enabled": false`: such a key is accepted, changes
nothing, and is listed in the config warning. The message always reads
"zerodp does not implement ...", never "unknown key": the user spelled the
key right, and needs to hear that the feature is missing, not that they
made a typo.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _never(value: Any) -> bool:
    return False


def _is(*expected: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == e and type(value) is type(e) for e in expected)


def _disabled(value: Any) -> bool:
    """DeepSpeed's convention: a feature block is off unless `"enabled": true`."""
    return isinstance(value, dict) and value.get("enabled", False) is False


def _compression_off(value: Any) -> bool:
    """Every technique of `compression_training` has `shared_parameters.enabled`."""
    if not isinstance(value, dict):
        return False
    for technique in value.values():
        if not isinstance(technique, dict):
            return False
        shared = technique.get("shared_parameters", technique)
        if not isinstance(shared, dict) or shared.get("enabled", False) is not False:
            return False
    return True


@dataclass(frozen=True)
class Unsupported:
    path: str
    feature: str  # "zerodp does not implement <feature>"
    instead: str  # what to do
    off: Callable[[Any], bool] = _never  # values that leave the feature off (accepted)
    schema_key: bool = False  # a typed section owns the key: checked here, kept for it
    off_why: str = ""  # the warning's text for an accepted value (default: "off (...)")

    def off_note(self) -> str:
        return self.off_why or f"off; zerodp does not implement {self.feature}"


_SET_DISABLED = 'set "enabled": false (or remove the block)'

UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported(
        "amp",
        "NVIDIA Apex AMP",
        'use "bf16": {"enabled": true} or "fp16": {"enabled": true}, and remove the block',
        _disabled,
    ),
    Unsupported(
        "torch_autocast",
        "torch.autocast mixed precision",
        'use "bf16" or "fp16" (zerodp casts the model), or call torch.autocast in your '
        'forward yourself; then set "enabled": false',
        _disabled,
    ),
    Unsupported(
        "hybrid_engine",
        "the Hybrid Engine",
        "generate with the module itself under torch.no_grad() between training steps "
        f"(DeepSpeed's inference kernels are not part of zerodp); {_SET_DISABLED}",
        _disabled,
    ),
    Unsupported(
        "pipeline",
        "pipeline parallelism",
        "remove the block; zerodp trains the whole model data-parallel (stage 3 shards it)",
    ),
    Unsupported(
        "sparse_attention",
        "sparse attention kernels",
        "remove the block and use torch's scaled_dot_product_attention (or a sparse "
        "attention package) inside the model",
    ),
    Unsupported(
        "data_efficiency",
        "the Data Efficiency library (curriculum sampling, random-LTD)",
        f"order and drop data in your own data loader; {_SET_DISABLED}",
        _disabled,
    ),
    Unsupported(
        "curriculum_learning",
        "curriculum learning",
        f"order the data in your own data loader; {_SET_DISABLED}",
        _disabled,
    ),
    Unsupported(
        "autotuning",
        "the autotuner",
        f"choose train_micro_batch_size_per_gpu and the ZeRO stage yourself; {_SET_DISABLED}",
        _disabled,
    ),
    Unsupported(
        "elasticity",
        "elastic batch sizes",
        f"set the batch sizes directly; {_SET_DISABLED}",
        _disabled,
    ),
    Unsupported(
        "compression_training",
        "the compression library (quantization-aware training, pruning, layer reduction)",
        "remove the block (or disable every technique in it)",
        _compression_off,
    ),
    Unsupported(
        "progressive_layer_drop",
        "progressive layer dropping",
        _SET_DISABLED,
        _disabled,
    ),
    Unsupported(
        "quantize_training",
        "quantization-aware training (MoQ)",
        _SET_DISABLED,
        _disabled,
    ),
    Unsupported(
        "weight_quantization",
        "weight quantization",
        "remove the block",
    ),
    Unsupported(
        "nebula",
        "the Nebula checkpoint service",
        f"zerodp saves with torch.distributed.checkpoint; {_SET_DISABLED}",
        _disabled,
    ),
    Unsupported(
        "wandb",
        "the WandB monitor",
        'log from your training loop, or use "tensorboard" or "csv_monitor"; ' + _SET_DISABLED,
        _disabled,
    ),
    Unsupported(
        "comet",
        "the Comet monitor",
        'log from your training loop, or use "tensorboard" or "csv_monitor"; ' + _SET_DISABLED,
        _disabled,
    ),
    # AutoTP's keys beyond what zerodp reads (zerodp.config.tensor_parallel).
    Unsupported(
        "tensor_parallel.partition_config",
        "DeepSpeed's AutoTP layer specs",
        'remove it and give zerodp\'s "plan": module-name patterns to "colwise" / "rowwise" '
        '(e.g. {"layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise"}); a Hugging '
        "Face model is split by its own plan without one (docs/tensor-parallel.md)",
        _is(None),
    ),
    Unsupported(
        "tensor_parallel.preset_model",
        "DeepSpeed's AutoTP presets",
        "remove it: a Hugging Face model is split by its own plan (base_model_tp_plan); for "
        'another model give zerodp\'s "plan"',
        _is(None),
    ),
    Unsupported(
        "tensor_parallel.injection_policy_tuple",
        "AutoTP injection policies",
        'remove it; name the split layers in zerodp\'s "plan" instead',
        _is(None),
    ),
    Unsupported(
        "tensor_parallel.replace_with_kernel_inject",
        "DeepSpeed's inference kernels",
        "set it to false (zerodp trains the model's own modules)",
        _is(False),
    ),
    Unsupported(
        "tensor_parallel.vocab_parallel_lm_head",
        "a vocabulary-parallel loss, or choosing the lm_head's split apart from the plan",
        "remove it (null): lm_head is split as the model's plan says (colwise_gather_output: "
        'its logits gathered whole); to keep it whole, give a "plan" without it',
        _is(None),
    ),
    Unsupported(
        "tensor_parallel.vocab_parallel_ce_backend",
        "a vocabulary-parallel loss (Liger's or DeepSpeed's)",
        'remove it (or set "torch"): the loss is computed on the gathered logits',
        lambda v: isinstance(v, str) and v.lower() == "torch",
    ),
    # AutoEP keys that would change the model's routing: zerodp routes as the model does.
    Unsupported(
        "expert_parallel.expert_tensor_parallel_size",
        "tensor parallelism inside each expert",
        "remove it (or set 1): each expert is whole on the rank that holds it",
        _is(1),
    ),
    Unsupported(
        "expert_parallel.top_k",
        "routing with another top-k than the model's",
        'remove it (or set "auto"): zerodp routes as the model does (its own num_experts_per_tok)',
        _is("auto"),
    ),
    Unsupported(
        "expert_parallel.score_func",
        "another routing score function than the model's",
        'remove it (or set "auto"): the model\'s router runs unchanged',
        _is("auto"),
    ),
    Unsupported(
        "expert_parallel.score_apply",
        "applying routing scores elsewhere than the model does",
        'remove it (or set "auto"): the routing weights are applied as the model applies them',
        _is("auto"),
    ),
    Unsupported(
        "expert_parallel.route_norm",
        "renormalising the routing weights apart from the model",
        "remove it (null): the model's own router (e.g. norm_topk_prob) decides",
        _is(None),
    ),
    Unsupported(
        "expert_parallel.route_scale",
        "scaling the routing weights apart from the model",
        "remove it (or set 1.0): the model's own router decides",
        _is(1.0, 1),
    ),
    Unsupported(
        "expert_parallel.routed_scaling_factor",
        "scaling the routed output apart from the model",
        'remove it (or set "auto"): the model\'s own factor applies',
        _is("auto"),
    ),
    Unsupported(
        "expert_parallel.num_expert_groups",
        "group-limited routing apart from the model",
        "remove it (null): a model with group-limited routing (DeepSeek-V3) routes as it is built",
        _is(None),
    ),
    Unsupported(
        "expert_parallel.num_limited_groups",
        "group-limited routing apart from the model",
        "remove it (null): a model with group-limited routing (DeepSeek-V3) routes as it is built",
        _is(None),
    ),
    Unsupported(
        "expert_parallel.load_balance_coeff",
        "DeepSpeed's router-bias load balancing",
        "remove it (null): the model's own auxiliary loss (output_router_logits) balances the load",
        _is(None),
    ),
    Unsupported(
        "compile.deepcompile",
        "DeepCompile",
        'set "deepcompile": false; "enabled": true compiles the model (or its blocks) with '
        "torch.compile",
        _is(False),
    ),
    Unsupported(
        "gradient_allreduce_op",
        "un-averaged (sum) gradient reduction",
        "remove the key: zerodp averages over ranks (multiply the loss by the world size "
        "for a sum)",
        lambda v: isinstance(v, str) and v.lower() == "mean",
    ),
    Unsupported(
        "checkpoint.use_node_local_storage",
        "node-local checkpoint storage",
        "save to a directory every rank can reach, or set it to false",
        _is(False),
    ),
    Unsupported(
        "checkpoint.parallel_write",
        "pipeline-stage parallel checkpoint writes",
        'remove it (or set "pipeline_stage": false)',
        lambda v: isinstance(v, dict) and not v.get("pipeline_stage", False),
    ),
    Unsupported(
        "checkpoint.writer.type",
        "DeepSpeed's mock checkpoint writer (it writes nothing)",
        'remove it (or set "fast"): zerodp always writes the checkpoint',
        lambda v: isinstance(v, str) and v.lower() in ("fast", "python"),
        off_why="zerodp writes with torch.distributed.checkpoint's file writer whatever the "
        "type (decoupled or not: checkpoint.writer.decoupled)",
    ),
    Unsupported(
        "zero_optimization.zero_quantized_weights",
        "ZeRO++ quantized weights",
        "set it to false",
        _is(False),
    ),
    Unsupported(
        "zero_optimization.zero_quantized_nontrainable_weights",
        "ZeRO++ quantized frozen weights",
        "set it to false",
        _is(False),
    ),
    Unsupported(
        "zero_optimization.zero_quantized_gradients",
        "ZeRO++ quantized gradients",
        "set it to false (zerodp reduces in the gradients' dtype or communication_data_type)",
        _is(False),
    ),
    Unsupported(
        "zero_optimization.zeropp_loco_param",
        "LoCo-ZeRO++ error feedback",
        "remove it",
        _is(None),
    ),
    Unsupported(
        "zero_optimization.zenflow",
        "ZenFlow",
        "remove it",
        _is(None),
    ),
)

# Optimizer types, by lower-cased name: (what zerodp does not implement, what to do).
_ADAMW = 'use "AdamW" (or "Adam")'
UNSUPPORTED_OPTIMIZERS: dict[str, tuple[str, str]] = {
    "onebitadam": ("1-bit Adam (compressed communication)", _ADAMW),
    "zerooneadam": ("0/1 Adam (compressed communication)", _ADAMW),
    "onebitlamb": ("1-bit LAMB (compressed communication)", 'use "Lamb"'),
    "muadam": ("muP optimizers", "build it with the mup package and pass optimizer="),
    "muadamw": ("muP optimizers", "build it with the mup package and pass optimizer="),
    "musgd": ("muP optimizers", "build it with the mup package and pass optimizer="),
    "lbfgs": ("L-BFGS", "its update is not elementwise, so it cannot step flat shards"),
    "sparseadam": ("SparseAdam", "zerodp reduces gradients dense; use AdamW"),
}
for _name in ("NAdam", "RAdam", "Adadelta", "ASGD", "Rprop"):
    UNSUPPORTED_OPTIMIZERS[_name.lower()] = (
        f"torch.optim.{_name} from the config",
        "the config builds Adam, AdamW, SGD, Adagrad, Adamax and RMSprop; pass "
        f"optimizer=lambda groups: torch.optim.{_name}(groups, ...) instead",
    )

UNSUPPORTED_SCHEDULERS: dict[str, tuple[str, str]] = {
    "onecycle": (
        "DeepSpeed's OneCycle scheduler",
        "pass lr_scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, ...)",
    ),
    "lrrangetest": (
        "DeepSpeed's LRRangeTest scheduler",
        "pass lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, ...)",
    ),
}
