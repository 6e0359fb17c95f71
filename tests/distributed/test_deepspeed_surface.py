"""DeepSpeed's script surface on real ranks: `zerodp.comm`'s functions with groups and async
handles, `zerodp.ops`' optimizers and the config's Lamb and Lion inside the engine at every
stage, `zerodp.checkpointing` under the backward lifecycle at every stage, the engine
attributes scripts read, and `initialize(args, model, ...)` in DeepSpeed's order."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
import torch.distributed as torch_dist

import zerodp
import zerodp.comm as dist
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyNet, tiny_inputs
from zerodp.errors import UnsupportedFeatureError
from zerodp.ops.adam import FusedAdam
from zerodp.ops.lamb import FusedLamb
from zerodp.optim.lamb import Lamb
from zerodp.optim.lion import Lion
from zerodp.testing import ReferenceDP
from zerodp.testing.parity import assert_grads_match, assert_params_match


def comm_functions() -> None:
    rank = dist.get_rank()
    assert (rank, dist.get_world_size()) == (torch_dist.get_rank(), 2)
    assert dist.get_local_rank() == rank and dist.is_initialized()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, prof=False, log_name="sum", debug="")  # DeepSpeed's keywords
    assert value.item() == 3.0
    value = torch.tensor([float(rank + 1)])
    handle = dist.all_reduce(value, op=dist.ReduceOp.MAX, async_op=True)
    handle.wait()
    assert value.item() == 2.0 and handle.is_completed()
    alone = dist.new_group([1])
    assert dist.get_rank(alone) == (0 if rank == 1 else -1)
    pair = dist.new_group([0, 1])
    assert dist.get_all_ranks_from_group(pair) == [0, 1]
    assert dist.get_global_rank(pair, 1) == 1 and dist.get_world_size(pair) == 2
    source = torch.tensor([float(rank)])
    dist.broadcast(source, src=1, group=pair)
    assert source.item() == 1.0
    pieces = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(pieces, torch.tensor([float(rank)]))
    assert [p.item() for p in pieces] == [0.0, 1.0]
    gathered = torch.zeros(2)
    dist.all_gather_into_tensor(gathered, torch.tensor([float(rank + 5)]))
    assert gathered.tolist() == [5.0, 6.0]
    shard = torch.zeros(1)
    dist.reduce_scatter_tensor(shard, torch.tensor([1.0, 2.0]) * (rank + 1))
    assert shard.item() == 3.0 * (rank + 1)
    objects: list[object] = [None, None]
    dist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": 0}, {"rank": 1}]
    swapped = torch.zeros(2)
    dist.all_to_all_single(swapped, torch.tensor([10.0 * rank, 10.0 * rank + 1]))
    assert swapped.tolist() == [float(rank), 10.0 + rank]
    tensors = [torch.ones(2), torch.full((3,), float(rank))]
    dist.all_reduce_coalesced(tensors)
    assert tensors[0].tolist() == [2.0, 2.0] and tensors[1].tolist() == [1.0] * 3
    if rank == 0:
        dist.send(torch.tensor([7.0]), dst=1)
    else:
        received = torch.zeros(1)
        dist.recv(received, src=0)
        assert received.item() == 7.0
    dist.barrier()
    with pytest.raises(TypeError, match="unexpected keyword"):
        dist.all_reduce(torch.zeros(1), bogus=True)


def test_comm_functions(pools) -> None:
    pools(2).run(comm_functions)


OPTIMIZERS = {
    # name: (how the engine gets it, the reference's optimizer on the same hyperparameters)
    "FusedAdam": (
        lambda model: {"optimizer": FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1)},
        lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
    ),
    "FusedLamb": (
        lambda model: {"optimizer": FusedLamb(model.parameters(), lr=1e-2, weight_decay=0.1)},
        lambda params: Lamb(params, lr=1e-2, weight_decay=0.1),
    ),
    "config_Lamb": (
        lambda model: {"config_optimizer": optimizer_config("Lamb", lr=1e-2, weight_decay=0.1)},
        lambda params: Lamb(params, lr=1e-2, weight_decay=0.1),
    ),
    "config_Lion": (
        lambda model: {"config_optimizer": optimizer_config("Lion", lr=1e-3, weight_decay=0.1)},
        lambda params: Lion(params, lr=1e-3, weight_decay=0.1),
    ),
}


def ops_optimizer(stage: int, name: str) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    ref_model = copy.deepcopy(model)
    engine_side, reference_optimizer = OPTIMIZERS[name]
    given = engine_side(model)
    config = zerodp_config(
        stage, optimizer=given.get("config_optimizer"), persistence_threshold=0, clipping=0.0
    )
    engine, *_ = zerodp.initialize(model=model, config=config, optimizer=given.get("optimizer"))
    reference = ReferenceDP(ref_model, reference_optimizer)
    for step in range(4):
        x = tiny_inputs(torch_dist.get_rank(), step)
        engine.backward(engine(x).square().mean())
        engine.step()
        reference.run_backward(lambda x=x: ref_model(x).square().mean().backward())
        reference.step()
        reference.zero_grad()
        assert_params_match(model, reference, f"{name}, stage {stage}, step {step}")
    engine.destroy()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_optimizers_in_the_engine(pools, stage: int, name: str) -> None:
    pools(2).run(ops_optimizer, stage, name)


class ForkedDropout(torch.nn.Module):
    """Megatron's pattern: dropout from the tracker's model-parallel state inside the block,
    dropout from the default generator after it."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.fc1 = torch.nn.Linear(7, 9)
        self.fc2 = torch.nn.Linear(9, 5)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        with zerodp.checkpointing.get_cuda_rng_tracker().fork():
            h = torch.nn.functional.dropout(h, 0.5)
        return torch.nn.functional.dropout(torch.tanh(h), 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return self.fc2(zerodp.checkpointing.checkpoint(self.block, x))
        return self.fc2(self.block(x))


def seeded(step: int) -> None:
    """The same generator states before the engine's forward and the reference's."""
    rank = torch_dist.get_rank()
    zerodp.checkpointing.model_parallel_cuda_manual_seed(1000 * step + 10 * rank)


def checkpointed_block(stage: int) -> None:
    torch.manual_seed(0)
    model = ForkedDropout(checkpointed=True)
    ref_model = copy.deepcopy(model)
    ref_model.checkpointed = False
    config = zerodp_config(
        stage,
        optimizer=optimizer_config("AdamW", lr=1e-2),
        persistence_threshold=0,
        clipping=0.0,
    )
    zerodp.checkpointing.configure(None)
    engine, *_ = zerodp.initialize(model=model, config=config)
    # DeepSpeed's "AdamW" (its FusedAdam) decays nothing unless told: weight_decay 0.
    reference = ReferenceDP(
        ref_model, lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0, fused=True)
    )
    for step in range(3):
        x = tiny_inputs(torch_dist.get_rank(), step)  # no requires_grad: non-reentrant
        seeded(step)
        loss = engine(x).square().mean()
        engine.backward(loss)
        seeded(step)
        reference.run_backward(lambda x=x: ref_model(x).square().mean().backward())
        assert_grads_match(model, reference, f"stage {stage}, step {step}")
        engine.step()
        reference.step()
        reference.zero_grad()
        assert_params_match(model, reference, f"stage {stage}, step {step}")
    engine.destroy()
    zerodp.checkpointing.get_cuda_rng_tracker().reset()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_activation_checkpointing_is_exact_at_every_stage(pools, stage: int) -> None:
    pools(2).run(checkpointed_block, stage)


def engine_attributes() -> None:
    torch.manual_seed(0)
    model = TinyNet()
    args = argparse.Namespace(local_rank=-1, deepspeed_config=None)
    config = zerodp_config(2, optimizer=optimizer_config("Adam", lr=1e-2), gas=2, clipping=0.5)
    # DeepSpeed's positional order: (args, model, optimizer, model_parameters).
    engine, optimizer, _, _ = zerodp.initialize(
        args, model, None, model.parameters(), config_params=config
    )
    assert args.local_rank == torch_dist.get_rank()  # as DeepSpeed sets it
    assert engine.module is model and optimizer is engine.optimizer
    assert (engine.dp_world_size, engine.mp_world_size, engine.world_size) == (2, 1, 2)
    assert engine.get_data_parallel_rank() == engine.global_rank == torch_dist.get_rank()
    assert engine.get_batch_info() == (16, 4, 2)
    assert engine.get_mom() == [(0.9, 0.999)]
    assert engine.optimizer_name() == "adam" and engine.optimizer_params()["lr"] == 1e-2
    assert engine.scheduler_name() is None and engine.gradient_clipping() == 0.5
    assert engine.zero_optimization() and engine.zero_optimization_partition_gradients()
    assert not engine.zero_optimization_partition_weights()
    assert not engine.has_moe_layers and not engine.pipeline_parallelism
    assert hasattr(engine.monitor, "write_events")
    engine.empty_partition_cache()
    for name in ("flops_profiler", "set_train_batch_size", "to", "train_batch"):
        with pytest.raises(UnsupportedFeatureError, match=f"engine.{name}: "):
            getattr(engine, name)
        assert not hasattr(engine, name)
    with pytest.raises(AttributeError, match="no attribute 'nosuch'"):
        engine.nosuch  # noqa: B018
    state = engine.module_state_dict()
    assert state.keys() == engine.state_dict().keys()
    engine.destroy()


def test_engine_attributes_scripts_read(pools) -> None:
    pools(2).run(engine_attributes)
