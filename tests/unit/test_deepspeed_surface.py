"""What a DeepSpeed script touches besides training, in one process: the names it imports,
DeepSpeed's module paths, one error per unsupported feature, the accelerator, the flags,
`zerodp run`'s DeepSpeed launcher options, activation checkpointing and its RNG tracker."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import zerodp
import zerodp.comm
from zerodp.accelerator import CpuAccelerator, get_accelerator
from zerodp.compat import modules, unsupported
from zerodp.compat.arguments import (
    add_config_arguments,
    config_from_arguments,
    deepspeed_argument_order,
    sync_local_rank,
)
from zerodp.engine.unsupported_attributes import UNSUPPORTED_ENGINE_ATTRIBUTES
from zerodp.errors import (
    ConfigWarning,
    UnsupportedFeatureError,
    UnsupportedModuleError,
    UsageError,
)
from zerodp.launch import runner

ROOT = Path(__file__).resolve().parents[2]


# -- zerodp.comm: DeepSpeed's face beside the internals ------------------------------------


FACES = ("accelerator", "ops", "checkpointing", "compat", "__init__.py")


def names_imported_from_comm() -> set[str]:
    """Every name zerodp's internal modules import with `from zerodp.comm import ...`."""
    names = set()
    for path in (ROOT / "zerodp").rglob("*.py"):
        if path.relative_to(ROOT / "zerodp").parts[0] in FACES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "zerodp.comm":
                names.update(alias.name for alias in node.names)
    return names


def test_the_comm_face_shadows_nothing_the_internals_import() -> None:
    face = importlib.import_module("zerodp.comm.public")
    internal = names_imported_from_comm()
    assert {"Comm", "ensure_process_group", "is_initialized"} <= internal
    for name in internal & set(face.__all__):
        # The one shared name is the same function in both.
        assert (
            getattr(zerodp.comm, name)
            is importlib.import_module("zerodp.comm.process_group").__dict__[name]
        )
    for name in internal - set(face.__all__):
        value = getattr(zerodp.comm, name)
        origin = value.__name__ if isinstance(value, type(zerodp)) else value.__module__
        assert origin != "zerodp.comm.public", name
    submodules = {p.stem for p in (ROOT / "zerodp" / "comm").glob("*.py")}
    assert not set(face.__all__) & submodules
    for name in face.__all__:
        assert getattr(zerodp.comm, name) is getattr(face, name)


def test_deepspeed_top_level_names_exist() -> None:
    for name in ("init_distributed", "add_config_arguments", "initialize", "comm", "zero", "utils"):
        assert hasattr(zerodp, name), name
    assert zerodp.DeepSpeedEngine is zerodp.ZeroEngine
    for name in ("set_z3_leaf_modules", "z3_leaf_module", "log_dist", "logger"):
        assert hasattr(zerodp.utils, name), name
    with pytest.raises(UnsupportedFeatureError, match=r"engine\.comm\.stats"):
        zerodp.comm.log_summary()


def test_comm_needs_the_process_group_first(monkeypatch: pytest.MonkeyPatch) -> None:
    # As in a fresh process, whatever an earlier test in this one set up.
    monkeypatch.setattr(
        importlib.import_module("zerodp.comm.public"), "is_initialized", lambda: False
    )
    with pytest.raises(UsageError, match=r"call zerodp.init_distributed\(\)"):
        zerodp.comm.get_rank()
    with pytest.raises(UsageError, match="dist_init_required=False"):
        zerodp.comm.init_distributed(dist_init_required=False)
    with pytest.raises(UsageError, match="zerodp uses 'gloo' on cpu"):
        zerodp.comm.init_distributed(dist_backend="mpi")


# -- DeepSpeed's module paths and the features zerodp does not have -----------------------


@pytest.mark.parametrize("path", sorted(unsupported.MODULES))
def test_every_unsupported_module_fails_at_import_with_its_message(path: str) -> None:
    with pytest.raises(UnsupportedModuleError) as info:
        importlib.import_module(f"zerodp.{path}")
    assert unsupported.MODULES[path] in str(info.value)
    assert isinstance(info.value, ModuleNotFoundError)


@pytest.mark.parametrize(
    ("module", "name"),
    [(m, n) for m, names in sorted(unsupported.ATTRIBUTES.items()) for n in sorted(names)],
)
def test_every_unsupported_name_fails_where_it_is_read(module: str, name: str) -> None:
    target = importlib.import_module(module)
    message = unsupported.ATTRIBUTES[module][name]
    with pytest.raises(UnsupportedFeatureError) as info:
        getattr(target, name)
    assert message in str(info.value)
    assert not hasattr(target, name)  # an AttributeError: feature probes take their fallback
    with pytest.raises(UnsupportedModuleError) as imported:
        exec(f"from {module} import {name}", {})  # the message survives `from ... import`
    assert message in str(imported.value)


def test_a_deepspeed_internal_module_gets_one_message() -> None:
    with pytest.raises(UnsupportedModuleError, match="DeepSpeed's internal module"):
        importlib.import_module("zerodp.runtime.zero.stage3")
    with pytest.raises(ModuleNotFoundError, match=r"No module named 'zerodp\.nosuchthing'"):
        importlib.import_module("zerodp.nosuchthing")


def test_deepspeed_module_paths_serve_zerodps_objects() -> None:
    from zerodp.runtime.activation_checkpointing import checkpointing
    from zerodp.runtime.base_optimizer import ZeROOptimizer
    from zerodp.runtime.engine import DeepSpeedEngine
    from zerodp.runtime.lr_schedules import WarmupCosineLR, WarmupLR
    from zerodp.runtime.zero.partition_parameters import (
        GatheredParameters,
        ZeroParamStatus,
    )

    assert checkpointing is zerodp.checkpointing
    assert DeepSpeedEngine is zerodp.ZeroEngine
    assert WarmupLR.__module__ == WarmupCosineLR.__module__ == "zerodp.optim.schedulers"
    assert GatheredParameters is zerodp.zero.GatheredParameters
    assert ZeroParamStatus is zerodp.zero.ParamStatus
    assert ZeROOptimizer.__name__ == "ZeroOptimizer"
    for path in modules.ALIASES:
        importlib.import_module(f"zerodp.{path}")
    assert modules.DeepSpeedPaths in {type(f) for f in sys.meta_path}


def test_engine_attributes_zerodp_lacks_are_not_engine_attributes() -> None:
    assert set(UNSUPPORTED_ENGINE_ATTRIBUTES) & set(dir(zerodp.ZeroEngine)) == set()


# -- the accelerator ------------------------------------------------------------------


def test_the_cpu_accelerator_answers_as_deepspeeds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZERODP_DEVICE", "cpu")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    accelerator = get_accelerator()
    assert isinstance(accelerator, CpuAccelerator)
    assert accelerator.device_name() == accelerator.current_device_name() == "cpu"
    assert accelerator.current_device() == 1 and accelerator.device_count() == 2
    assert accelerator.communication_backend_name() == "gloo"
    assert accelerator.is_bf16_supported() and accelerator.device() is None
    assert accelerator.is_synchronized_device() and accelerator.is_available()
    assert torch.float32 in accelerator.supported_dtypes()
    assert accelerator.memory_allocated() > 0
    assert accelerator.max_memory_allocated() >= accelerator.memory_allocated()
    assert accelerator.total_memory() >= accelerator.available_memory() > 0
    state = accelerator.get_rng_state()
    accelerator.manual_seed(3)
    first = torch.rand(3)
    accelerator.set_rng_state(state)
    accelerator.manual_seed(3)
    assert torch.equal(torch.rand(3), first)
    assert accelerator.on_accelerator(torch.zeros(1))
    assert accelerator.create_op_builder("FusedAdamBuilder") is None


def test_ds_accelerator_naming_another_device_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZERODP_DEVICE", "cpu")
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(UsageError, match="set ZERODP_DEVICE=cuda"):
        get_accelerator()


# -- DeepSpeed's flags and initialize(args=...) ---------------------------------------


def test_add_config_arguments_adds_deepspeeds_flags() -> None:
    parser = add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json"
    assert not args.deepscale and args.deepscale_config is None


def test_the_config_comes_from_one_place() -> None:
    args = argparse.Namespace(deepspeed_config="ds.json")
    assert config_from_arguments(args, None, None) == "ds.json"
    assert config_from_arguments(argparse.Namespace(deepscale_config="old.json"), None, None) == (
        "old.json"
    )
    assert config_from_arguments(None, {"a": 1}, None) == {"a": 1}
    assert config_from_arguments(argparse.Namespace(deepspeed_config=None), None, {"b": 2}) == {
        "b": 2
    }
    with pytest.raises(UsageError, match=r"config= and args.deepspeed_config \('ds.json'"):
        config_from_arguments(args, {"train_batch_size": 2}, None)
    with pytest.raises(UsageError, match="config= and config_params="):
        config_from_arguments(None, {"a": 1}, {"a": 2})
    both = argparse.Namespace(deepspeed_config="a.json", deepscale_config="b.json")
    with pytest.raises(UsageError, match=r"args\.deepspeed_config .* and args\.deepscale_config"):
        config_from_arguments(both, None, None)


def test_local_rank_follows_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    args = argparse.Namespace(local_rank=-1)
    sync_local_rank(args)
    assert args.local_rank == 1
    with pytest.raises(UsageError, match="LOCAL_RANK=1"):
        sync_local_rank(argparse.Namespace(local_rank=0))


def test_deepspeeds_positional_order_is_recognised() -> None:
    model = torch.nn.Linear(2, 2)
    assert deepspeed_argument_order(argparse.Namespace(), model)
    assert deepspeed_argument_order(None, model)
    assert not deepspeed_argument_order(model, {"train_batch_size": 2})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mpu": object()}, "a Megatron mpu is not read"),
        ({"mesh_param": (2, 1)}, "zerodp builds its mesh from the config"),
    ],
)
def test_initialize_refuses_model_parallel_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        zerodp.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 1}, **kwargs)


# -- zerodp run with DeepSpeed's launcher options ---------------------------------------


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


def plan(*argv: str) -> runner.RunPlan:
    return runner.plan_run([*argv, "train.py", "--deepspeed"])


def test_num_gpus_starts_that_many_processes_with_local_rank(script: Path) -> None:
    result = plan("--num_gpus", "2")
    assert result.nproc_per_node == "2"
    assert result.torchrun_argv == (
        *("--standalone", "--nproc-per-node", "2"),
        *("-m", "zerodp.launch.local_rank", "--as", "script", "train.py", "--deepspeed"),
    )
    assert plan("-n", "2").torchrun_argv == (
        "--standalone",
        "--nproc-per-node",
        "2",
        "train.py",
        "--deepspeed",
    )


def test_include_exclude_and_a_one_host_hostfile(script: Path) -> None:
    result = plan("--include", "localhost:0,2")
    assert result.nproc_per_node == "2" and result.env["CUDA_VISIBLE_DEVICES"] == "0,2"
    hostfile = script.parent / "hosts"
    hostfile.write_text("# one machine\nworker-0 slots=4\n")
    result = plan("--hostfile", str(hostfile), "--exclude", "worker-0:1")
    assert result.nproc_per_node == "3" and result.env["CUDA_VISIBLE_DEVICES"] == "0,2,3"
    with pytest.raises(runner.RunUsageError, match="cannot be combined with --include"):
        plan("--num_gpus", "2", "--include", "localhost:0")
    with pytest.raises(runner.RunUsageError, match="no device slots to exclude"):
        plan("--exclude", "localhost:0")


def test_several_hosts_are_started_from_here_or_each_with_no_ssh(script: Path) -> None:
    hostfile = script.parent / "hosts"
    hostfile.write_text("a slots=2\nb slots=2\n")
    started = plan("--hostfile", str(hostfile))  # tests/unit/test_multinode_launch.py
    assert isinstance(started, runner.HostsPlan) and started.hosts.hosts == ["a", "b"]
    result = plan("--hostfile", str(hostfile), "--no_ssh", "--node_rank", "1")
    assert result.torchrun_argv[:8] == (
        *("--nproc-per-node", "2", "--nnodes", "2"),
        *("--master-addr", "a", "--master-port", "29500"),
    )
    assert "--standalone" not in result.torchrun_argv


def test_other_deepspeed_options(script: Path) -> None:
    result = plan("--num_gpus", "2", "--no_local_rank", "--enable_each_rank_log", "logs")
    assert result.torchrun_argv == (
        *("--standalone", "--nproc-per-node", "2", "--log-dir", "logs", "--redirects", "3"),
        *("train.py", "--deepspeed"),
    )
    result = plan("--num_gpus", "2", "--bind_cores_to_rank", "--log_level", "warning")
    assert "--bind_cores_to_rank, --log_level" in result.notes[0]
    result = plan("--num_gpus", "2", "--launcher", "slurm", "--no_ssh")
    assert "--launcher, --no_ssh" in result.notes[0]  # they serve several nodes
    with pytest.raises(runner.RunUsageError, match="disagree"):
        plan("-n", "3", "--num_gpus", "2")
    with pytest.raises(runner.RunUsageError, match="no autotuner"):
        plan("--num_gpus", "2", "--autotuning", "tune")
    module = runner.plan_run(["--num_gpus", "2", "--module", "pkg.train", "--x"])
    assert module.torchrun_argv == (
        *("--standalone", "--nproc-per-node", "2"),
        *("-m", "zerodp.launch.local_rank", "--as", "module", "pkg.train", "--x"),
    )


def test_the_local_rank_wrapper_runs_the_script_as_deepspeed_does(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(
        "import json, os, sys\n"
        "print(json.dumps([__name__, sys.argv[1:], os.environ['LOCAL_SIZE'],"
        " os.environ['CROSS_SIZE'], os.path.basename(sys.path[0])]))\n"
    )
    env = {**os.environ, "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}
    done = subprocess.run(
        [sys.executable, "-m", "zerodp.launch.local_rank", "--as", "script", str(script), "a"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    name, argv, local_size, cross_size, path0 = json.loads(done.stdout)
    assert name == "__main__" and argv == ["--local_rank=3", "a"]
    assert (local_size, cross_size, path0) == ("4", "2", tmp_path.name)


# -- activation checkpointing ------------------------------------------------------------


def test_configure_says_what_has_no_effect(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"activation_checkpointing": {"partition_activations": True}}))
    with pytest.warns(ConfigWarning, match="partition_activations: there is no model-parallel"):
        zerodp.checkpointing.configure(None, deepspeed_config=str(config))
    assert zerodp.checkpointing.is_configured()
    with pytest.raises(UsageError, match="needs partition_activations"):
        zerodp.checkpointing.configure(None, contiguous_checkpointing=True)
    tensor_parallel = argparse.Namespace(get_model_parallel_world_size=lambda: 2)
    with pytest.raises(UsageError, match="2 model-parallel ranks"):
        zerodp.checkpointing.configure(tensor_parallel)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zerodp.checkpointing.configure(None)  # nothing asked: no warning


def test_the_rng_tracker_forks_and_keeps_its_state() -> None:
    tracker = zerodp.checkpointing.get_cuda_rng_tracker()
    tracker.reset()
    zerodp.checkpointing.model_parallel_cuda_manual_seed(11)
    outside = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside)  # the default generator is untouched
    with tracker.fork():
        second = torch.rand(4)
    torch.manual_seed(11 + 2718)
    assert torch.equal(torch.cat([first, second]), torch.rand(8))  # one stream, continued
    with pytest.raises(UsageError, match="seed 2729 is already used"):
        tracker.add("other", 2729)
    with pytest.raises(UsageError, match="no state 'missing'"):
        tracker.fork("missing").__enter__()
    tracker.reset()


class ForkedDropout(torch.nn.Module):
    """A Linear, dropout drawn from the tracker's model-parallel state, dropout drawn from
    the default generator, and a second Linear (Megatron's pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        with zerodp.checkpointing.get_cuda_rng_tracker().fork():
            h = torch.nn.functional.dropout(h, 0.5)
        return torch.nn.functional.dropout(torch.tanh(h), 0.3)

    def forward(self, x: torch.Tensor, checkpointed: bool) -> torch.Tensor:
        h = zerodp.checkpointing.checkpoint(self.block, x) if checkpointed else self.block(x)
        return self.fc2(h)


def test_checkpoint_recomputes_with_the_same_masks() -> None:
    """Gradients with the block checkpointed equal those without (every generator restored);
    the input does not require grad and fc1 still gets its gradient."""
    torch.manual_seed(0)
    model = ForkedDropout()
    x = torch.randn(5, 6)
    grads = []
    for checkpointed in (False, True):
        model.zero_grad()
        zerodp.checkpointing.model_parallel_cuda_manual_seed(5)
        model(x, checkpointed).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, recomputed in zip(*grads, strict=True):
        assert torch.equal(plain, recomputed)
    assert grads[1][0].abs().sum() > 0
    zerodp.checkpointing.get_cuda_rng_tracker().reset()


def test_checkpoint_returns_outputs_as_deepspeed_does() -> None:
    x = torch.randn(2, requires_grad=True)
    assert isinstance(zerodp.checkpointing.checkpoint(lambda t: t * 2, x), torch.Tensor)
    single = zerodp.checkpointing.checkpoint(lambda t: (t * 2,), x)
    assert isinstance(single, torch.Tensor)
    pair = zerodp.checkpointing.checkpoint(lambda t: [t * 2, t * 3], x)
    assert isinstance(pair, tuple) and len(pair) == 2
