"""Every optimizer and scheduler default zerodp applies is the one DeepSpeed 0.19.8 applies.

Each test states the rule and checks it on its own (torch's signatures, the
closed forms); where DeepSpeed is importable it also asks DeepSpeed's own code
path: which class `DeepSpeedEngine.get_optimizer_configuration` picks for the
config, that class's constructor defaults, `get_gradient_clipping({})`, and
DeepSpeed's schedulers stepped beside zerodp's. DeepSpeed 0.19.8 is in the test
extras, so those run on every checkout set up with `make setup`.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from zerodp.config import load_config
from zerodp.errors import ConfigError, ConfigWarning
from zerodp.optim.factory import optimizer_sources
from zerodp.optim.param_groups import resolve_param_groups
from zerodp.optim.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(autouse=True, scope="module")
def deepspeeds_cpu_accelerator() -> Iterator[None]:
    """DeepSpeed's CPU accelerator, as `DS_ACCELERATOR=cpu` chooses it: zerodp's defaults
    here are the CPU's (`built(device="cpu")`), and DeepSpeed picks its accelerator once, at
    its first use, by probing the machine otherwise (a GPU's own, or the CPU with a warning).
    Only while this module runs: zerodp refuses a `DS_ACCELERATOR` that names another device
    than its own, which on a GPU machine the CPU is."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DS_ACCELERATOR", "cpu")
        yield


def built(optimizer: dict[str, Any], device: str = "cpu", **top: Any) -> tuple[type, dict]:
    """(class, kwargs) of the optimizer zerodp builds for the config's block."""
    config = load_config({"train_batch_size": 2, "optimizer": optimizer, **top}, world_size=1)
    specs = resolve_param_groups(torch.nn.Linear(2, 2), None, None)
    _, (source,), _ = optimizer_sources(
        None, config.optimizer, specs, {}, prefer_fused=device in ("cpu", "cuda")
    )
    assert source.cls is not None
    return source.cls, source.kwargs


def default_of(cls: type, name: str) -> Any:
    return inspect.signature(cls.__init__).parameters[name].default


ADAM_CASES = [
    # (config type, params, class DeepSpeed builds, its weight_decay default source)
    ("AdamW", {"torch_adam": True}, torch.optim.AdamW),
    ("Adam", {"torch_adam": True}, torch.optim.AdamW),  # adam_w_mode defaults to true
    ("Adam", {"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam),
    ("AdamW", {"torch_adam": True, "adam_w_mode": False}, torch.optim.AdamW),  # the type wins
    ("AdamW", {}, None),  # DeepSpeed's FusedAdam (or CPU Adam): weight_decay 0
    ("Adam", {"adam_w_mode": False}, None),
]


@pytest.mark.parametrize(("kind", "params", "torch_class"), ADAM_CASES)
def test_adam_weight_decay_default_follows_the_class_deepspeed_builds(
    kind: str, params: dict, torch_class: type | None
) -> None:
    """`torch_adam` builds torch's class without weight_decay, so torch's default applies
    (AdamW 0.01, Adam 0); otherwise DeepSpeed's own Adam, whose default is 0."""
    cls, kwargs = built({"type": kind, "params": {"lr": 0.01, **params}})
    expected = 0.0 if torch_class is None else default_of(torch_class, "weight_decay")
    assert kwargs["weight_decay"] == expected
    decoupled = kind == "AdamW" or params.get("adam_w_mode", True)
    assert cls is (torch.optim.AdamW if decoupled else torch.optim.Adam)


def test_torch_adam_leaves_the_kernel_to_torch() -> None:
    """DeepSpeed passes only the config's keys to torch's class; zerodp's preference for the
    fused kernel (which differs in the last bit) must not apply then."""
    _, kwargs = built({"type": "AdamW", "params": {"torch_adam": True}})
    assert "fused" not in kwargs and "foreach" not in kwargs
    _, kwargs = built({"type": "AdamW", "params": {}})
    assert kwargs["fused"] is True


def test_torch_adam_refuses_bias_correction_off() -> None:
    with pytest.raises(
        ConfigError, match=r"bias_correction' false and 'optimizer\.params\.torch_adam' true"
    ):
        built({"type": "AdamW", "params": {"torch_adam": True, "bias_correction": False}})


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="compares with DeepSpeed's code path")
@pytest.mark.parametrize(("kind", "params", "torch_class"), ADAM_CASES)
@pytest.mark.parametrize("offload", [False, True], ids=["device", "cpu_offload"])
def test_adam_defaults_match_deepspeeds_code_path(
    kind: str, params: dict, torch_class: type | None, offload: bool
) -> None:
    """DeepSpeed's own choice of class for the block, and that class's defaults."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    engine = types.SimpleNamespace(
        zero_use_cpu_optimizer=lambda: offload,
        bf16_optimizer_states=lambda: False,
        zenflow=False,
    )
    ds_params = dict(params)
    adam_w_mode = ds_params.pop("adam_w_mode", True)
    decoupled = kind == "AdamW" or adam_w_mode
    ds_class, ds_kwargs = DeepSpeedEngine.get_optimizer_configuration(engine, ds_params, decoupled)
    if torch_class is not None:
        assert ds_class is torch_class
    ds_decay = default_of(ds_class, "weight_decay")
    zerodp_block = {"type": kind, "params": {"lr": 0.01, **params}}
    offload_block = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    _, kwargs = built(zerodp_block, **(offload_block if offload else {}))
    assert kwargs["weight_decay"] == ds_decay
    assert kwargs["eps"] == default_of(ds_class, "eps")
    assert tuple(kwargs["betas"]) == tuple(default_of(ds_class, "betas"))
    if "adamw_mode" in ds_kwargs or "adam_w_mode" in ds_kwargs:
        assert bool(ds_kwargs.get("adamw_mode", ds_kwargs.get("adam_w_mode"))) == decoupled


def lamb_and_lion_defaults() -> list[tuple[str, dict[str, Any]]]:
    """The defaults zerodp's config gives "Lamb" and "Lion" (no params written)."""
    out = []
    for kind in ("Lamb", "Lion"):
        _, kwargs = built({"type": kind})
        out.append((kind, kwargs))
    return out


def test_lamb_and_lion_defaults_are_deepspeeds() -> None:
    """DeepSpeed's FusedLamb: lr 1e-3, eps 1e-8, betas (0.9, 0.999), weight decay 0, trust
    ratio clamped to [0.01, 10]; FusedLion: lr 1e-3, betas (0.9, 0.999), weight decay 0."""
    (_, lamb), (_, lion) = lamb_and_lion_defaults()
    assert lamb == {
        "lr": 1e-3,
        "bias_correction": True,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "eps_inside_sqrt": False,
        "weight_decay": 0.0,
        "max_coeff": 10.0,
        "min_coeff": 0.01,
    }
    assert lion == {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="compares with DeepSpeed's classes")
def test_ops_and_config_defaults_match_deepspeeds_classes() -> None:
    """zerodp.ops' classes and the config blocks take DeepSpeed's constructor defaults."""
    import deepspeed.ops.adagrad as ds_adagrad
    import deepspeed.ops.adam as ds_adam
    import deepspeed.ops.lamb as ds_lamb
    import deepspeed.ops.lion as ds_lion

    import zerodp.ops.adagrad
    import zerodp.ops.adam
    import zerodp.ops.lamb
    import zerodp.ops.lion

    pairs = [
        (ds_adam.FusedAdam, zerodp.ops.adam.FusedAdam),
        (ds_adam.DeepSpeedCPUAdam, zerodp.ops.adam.DeepSpeedCPUAdam),
        (ds_lamb.FusedLamb, zerodp.ops.lamb.FusedLamb),
        (ds_lion.FusedLion, zerodp.ops.lion.FusedLion),
        (ds_lion.DeepSpeedCPULion, zerodp.ops.lion.DeepSpeedCPULion),
        (ds_adagrad.DeepSpeedCPUAdagrad, zerodp.ops.adagrad.DeepSpeedCPUAdagrad),
    ]
    for theirs, ours in pairs:
        assert _defaults(ours) == _defaults(theirs), theirs.__name__
    config_lamb, config_lion = (kwargs for _, kwargs in lamb_and_lion_defaults())
    lamb_defaults = _defaults(ds_lamb.FusedLamb)
    assert {k: lamb_defaults[k] for k in config_lamb} == config_lamb
    lion_defaults = _defaults(ds_lion.FusedLion)
    assert {k: lion_defaults[k] for k in config_lion} == config_lion


def _defaults(cls: type) -> dict[str, Any]:
    return {
        name: tuple(p.default) if isinstance(p.default, (tuple, list)) else p.default
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


@pytest.mark.parametrize(
    ("kind", "torch_class"),
    [
        ("SGD", torch.optim.SGD),
        ("Adagrad", torch.optim.Adagrad),
        ("Adamax", torch.optim.Adamax),
        ("RMSprop", torch.optim.RMSprop),
    ],
)
def test_torch_optimizers_get_torchs_defaults(kind: str, torch_class: type) -> None:
    """DeepSpeed builds these as `getattr(torch.optim, type)(params, **params)`."""
    cls, kwargs = built({"type": kind})
    assert cls is torch_class
    for name, value in kwargs.items():
        if name not in ("foreach", "fused"):
            expected = default_of(torch_class, name)
            assert (tuple(value) if name == "betas" else value) == expected, name


def test_gradient_clipping_defaults_to_one() -> None:
    """DeepSpeed 0.19.3 made 1.0 the default (#8068): a config without the key clips."""
    assert load_config({"train_batch_size": 2}, world_size=1).gradient_clipping == 1.0
    assert (
        load_config({"train_batch_size": 2, "gradient_clipping": 0}, world_size=1).gradient_clipping
        == 0
    )


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="compares with DeepSpeed's config")
def test_gradient_clipping_default_is_deepspeeds() -> None:
    from deepspeed.runtime.config import get_gradient_clipping

    config = load_config({"train_batch_size": 2}, world_size=1)
    assert config.gradient_clipping == get_gradient_clipping({})


# -- schedulers -------------------------------------------------------------------------


def _optimizer(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


SCHEDULES = [
    ("WarmupLR", {}),
    ("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear", "warmup_max_lr": 0.5}),
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_num_steps": 5}),
    ("WarmupDecayLR", {"total_num_steps": 10}),  # the decay ends before the 1000-step warmup
    ("WarmupDecayLR", {"total_num_steps": 5, "warmup_num_steps": 5}),
    ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 5}),
    ("WarmupCosineLR", {"total_num_steps": 3, "warmup_num_steps": 8, "warmup_type": "linear"}),
]
ZERODP_SCHEDULES = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


@pytest.mark.parametrize(("kind", "params"), SCHEDULES)
def test_a_decay_shorter_than_its_warmup_is_accepted(kind: str, params: dict) -> None:
    """DeepSpeed accepts total_num_steps <= warmup_num_steps (it warns); so does zerodp, with
    DeepSpeed's closed form: after the warmup, WarmupDecayLR is at warmup_min_lr and
    WarmupCosineLR at cos_min_ratio."""
    load_config({"train_batch_size": 2, "scheduler": {"type": kind, "params": params}}, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched = ZERODP_SCHEDULES[kind](_optimizer(), **params)
    total = params.get("total_num_steps")
    warmup = max(2, params.get("warmup_num_steps", 1000))
    assert any(issubclass(w.category, ConfigWarning) for w in caught) == (
        total is not None and total < warmup
    )
    for _ in range(warmup + 3):
        sched.optimizer.step()
        sched.step()
    t = warmup + 3 - 1
    lr = sched.get_last_lr()[0]
    if kind == "WarmupDecayLR":
        expected = 0.001 * max(0.0, (total - t) / max(1, total - warmup))
        assert lr == pytest.approx(expected, abs=1e-15)
    elif kind == "WarmupCosineLR":
        progress = min(1.0, (t - warmup + 1) / max(1, total - warmup))
        ratio = 1e-4 + (1 - 1e-4) * 0.5 * (1 + math.cos(math.pi * progress))
        assert lr == pytest.approx(0.1 * ratio, rel=1e-12)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="compares with DeepSpeed's schedulers")
@pytest.mark.parametrize(("kind", "params"), SCHEDULES)
def test_schedules_and_their_defaults_match_deepspeeds(kind: str, params: dict) -> None:
    """Defaults (every keyword left out) and each step's lr, DeepSpeed's class beside zerodp's."""
    from deepspeed.runtime import lr_schedules

    theirs_class = getattr(lr_schedules, kind)
    ours_class = ZERODP_SCHEDULES[kind]
    skip = {"self", "optimizer", "total_num_steps"}
    assert {k: v for k, v in _defaults(theirs_class).items() if k not in skip} == {
        k: v for k, v in _defaults(ours_class).items() if k not in skip
    }
    ours_opt, theirs_opt = _optimizer(), _optimizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = ours_class(ours_opt, **params)
        theirs = theirs_class(theirs_opt, **params)
    for step in range(40):
        assert ours_opt.param_groups[0]["lr"] == theirs_opt.param_groups[0]["lr"], step
        ours_opt.step()
        ours.step()
        theirs.step()
