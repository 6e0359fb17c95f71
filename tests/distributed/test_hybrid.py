"""Several nodes, simulated: shard groups (`mics_shard_size`) and hpZ, exact, bytes by formula.

One pool of 4 processes for the whole module, as 2 simulated nodes x 2 ranks
(`ZERODP_NODE_SIZE=2`). Every training case runs zerodp beside the data-parallel reference
computed in the test (`tests.lockstep.Lockstep`: a plain model copy per rank, each backward's
gradients averaged over all 4 ranks with an explicit all_reduce), compares every full
gradient after every backward and every weight after every step, and after every step checks
that the ranks of each replica group hold bitwise equal shards, optimizer copies and optimizer
state. The default run covers stages 1-3 with shard groups of 2, stage 3 with hpZ 2 and with
both, at 1 and 4 micro-batches, each backward pattern (retained graph, double backward,
activation checkpointing), bf16 and fp16 with clipping, optimizer offload, zero.Init, leaf
modules, zero-element parameters and compile (one layout); the bytes of a step against the
closed form; checkpoints across shard sizes and world sizes; hpZ's copies after every kind of
change; the errors for groups that would span nodes. `ZERODP_HYBRID_FULL=1` runs the whole
cross product (layouts x 1 and 4 micro-batches x patterns x fp32 and bf16 x clipping),
compile at every layout and the HF Trainer.
"""

from __future__ import annotations

import itertools
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerodp
from bench._hybrid_math import stage3_step_bytes
from tests.configs import optimizer_config, zerodp_config
from tests.distributed.test_backward_head import (
    evaluation_case,
    inference_engine_case,
    uneven_drop_case,
)
from tests.lockstep import Lockstep
from tests.models import LifecycleNet, TinyNet, lifecycle_inputs, tiny_inputs
from tests.moe_models import TwoExpertNet, two_expert_inputs
from zerodp.comm.agreement import agreement
from zerodp.errors import ConfigWarning
from zerodp.testing import WorkerPool

NODES = {"ZERODP_NODE_SIZE": "2"}  # 4 processes as 2 nodes of 2 ranks
FULL = os.environ.get("ZERODP_HYBRID_FULL") == "1"

# name: (stage, mics_shard_size, zero_hpz_partition_size)
LAYOUTS = {
    "stage1_shard2": (1, 2, 1),
    "stage2_shard2": (2, 2, 1),
    "stage3_shard2": (3, 2, 1),
    "stage3_hpz2": (3, -1, 2),
    "stage3_shard2_hpz2": (3, 2, 2),
}
FLAT = {"stage3_flat": (3, -1, 1), "stage2_flat": (2, -1, 1)}  # to compare with
PATTERNS = ("plain", "retain", "double", "checkpoint")
ADAMW = optimizer_config("AdamW", lr=1e-2, weight_decay=0.0)


def _reference_adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)


@pytest.fixture(scope="module")
def pool() -> Any:
    workers = WorkerPool(4, env=NODES)
    yield workers
    workers.close()


def hybrid_config(layout: str, **kwargs: Any) -> dict[str, Any]:
    stage, shard, hpz = {**LAYOUTS, **FLAT}[layout]
    zero = {"mics_shard_size": shard, "zero_hpz_partition_size": hpz, "reduce_bucket_size": 64}
    zero.update(kwargs.pop("zero", {}))
    kwargs.setdefault("persistence_threshold", 10 if stage == 3 else None)
    return zerodp_config(stage, optimizer=ADAMW, zero=zero, **kwargs)


def quiet_initialize_warnings() -> None:
    """hpZ equal to the shard group's size says it has no effect (asserted elsewhere)."""
    warnings.filterwarnings("ignore", category=ConfigWarning)


# -- every shard of a replica group is bitwise the same -----------------------------------------


def replica_tensors(engine: Any) -> torch.Tensor:
    """Everything this rank holds of the model's state, flattened: shards (or the full buffer of a
    persistent group), optimizer copies and optimizer state, in group order."""
    parts: list[torch.Tensor] = []
    for state in engine.groups:
        flat = state.flat
        parts.append(flat.shard if state.gather is not None else flat.full)
        if state.optim is not None:
            if state.optim.copy is not None:
                parts.append(state.optim.copy)
            slots = engine.optimizer.state.get(state.optim.param, {})
            parts += [slots[k] for k in sorted(slots) if torch.is_tensor(slots[k])]
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in parts])


def assert_replicas_equal(engine: Any, where: str) -> int:
    """Every rank of this rank's replica group holds bitwise this rank's state; returns how many
    ranks were compared (1 without replicas)."""
    replica = engine.comms.replica
    if replica is None:
        return 1
    mine = replica_tensors(engine)
    gathered = torch.empty(mine.numel() * replica.world_size, dtype=mine.dtype)
    replica.all_gather(gathered, mine)
    for index, theirs in enumerate(gathered.chunk(replica.world_size)):
        assert torch.equal(theirs, mine), f"{where}: replica {index} differs from this rank's"
    return replica.world_size


# -- training beside the reference -----------------------------------------------------------


def _backward(run: Lockstep, pattern: str, x: torch.Tensor) -> None:
    # LifecycleNet reads `checkpoint` at every forward: both models recompute `mid` or not.
    for model in (run.model, run.ref_model):
        model.checkpoint = "non_reentrant" if pattern == "checkpoint" else None
    if pattern == "double":  # a gradient penalty: the second-order graph reads the weights
        xz, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        out, ref = run.engine(xz).float(), run.ref_model(xr).float()
        (gz,) = torch.autograd.grad(out.sum(), xz, create_graph=True)
        (gr,) = torch.autograd.grad(ref.sum(), xr, create_graph=True)
        losses = (
            out.square().mean() + gz.square().mean(),
            ref.square().mean() + gr.square().mean(),
        )
        run.backward(losses)
        return
    out, ref = run.forward(x)
    losses = (out.square().mean(), ref.square().mean())
    if pattern == "retain":  # a second backward on the retained graph, without a new forward
        run.backward(losses, retain_graph=True)
    run.backward(losses)


def parity_case(
    layout: str,
    gas: int,
    pattern: str,
    dtype: str = "fp32",
    clip: float | None = None,
    zero: dict[str, Any] | None = None,
    steps: int = 2,
) -> dict[str, int]:
    """`pattern` "cycle": each micro-batch the next of PATTERNS (double backward in fp32 only)."""
    quiet_initialize_warnings()
    torch.manual_seed(0)
    model = LifecycleNet()
    config = hybrid_config(layout, gas=gas, dtype=dtype, clipping=clip, zero=zero or {})
    label = f"{layout}, gas {gas}, {pattern}, {dtype}, clip {clip}, {zero}"
    # fp16: the reference sums the 4 ranks' gradients in fp16 at once, zerodp the 2 of a shard
    # group in fp16 and then the 2 replicas in the fp32 kept gradient: roundings differ.
    tolerance = {"rtol": 2e-3, "atol": 5e-5} if dtype == "fp16" else None
    run = Lockstep(model, config, _reference_adamw, label=label, grad_tolerance=tolerance)
    cycle = [p for p in PATTERNS if dtype == "fp32" or p != "double"]
    rank = dist.get_rank()
    replicas = 0
    for step in range(steps):
        for micro in range(gas):
            index = step * gas + micro
            current = cycle[index % len(cycle)] if pattern == "cycle" else pattern
            _backward(run, current, lifecycle_inputs(rank, index))
            if run.step():
                replicas = assert_replicas_equal(run.engine, f"{label}, step {step}")
    counts = {"grads": run.grad_comparisons, "params": run.param_comparisons, "replicas": replicas}
    run.check_all_released()
    run.close()
    return counts


def parity_cases(cases: list[dict[str, Any]]) -> list[dict[str, int]]:
    return [parity_case(**case) for case in cases]


def _cases() -> list[dict[str, Any]]:
    if FULL:
        patterns = (*PATTERNS, "cycle")
        product = itertools.product(LAYOUTS, (1, 4), patterns, ("fp32", "bf16"), (None, 0.05))
        return [
            {"layout": layout, "gas": gas, "pattern": pattern, "dtype": dtype, "clip": clip}
            for layout, gas, pattern, dtype, clip in product
            if not (pattern == "double" and dtype != "fp32")
        ]
    # Each layout: one micro-batch per step with every pattern in turn across steps and
    # layouts, and four micro-batches per step, each a different pattern.
    cases: list[dict[str, Any]] = []
    for index, layout in enumerate(LAYOUTS):
        cases += [{"layout": layout, "gas": 1, "pattern": PATTERNS[index % len(PATTERNS)]}]
        cases += [{"layout": layout, "gas": 4, "pattern": "cycle"}]
    cases += [
        {"layout": "stage3_shard2", "gas": 2, "pattern": "cycle", "dtype": "bf16", "clip": 0.05},
        {"layout": "stage2_shard2", "gas": 2, "pattern": "retain", "dtype": "fp16", "clip": 0.05},
        {"layout": "stage1_shard2", "gas": 2, "pattern": "cycle", "dtype": "bf16"},
        {"layout": "stage3_hpz2", "gas": 2, "pattern": "checkpoint", "dtype": "bf16", "clip": 0.05},
        {
            "layout": "stage3_shard2",
            "gas": 2,
            "pattern": "plain",
            "clip": 0.05,
            "zero": {"offload_optimizer": {"device": "cpu"}, "overlap_comm": False},
        },
    ]
    return cases


def test_training_matches_the_reference_and_replicas_stay_equal(pool: WorkerPool) -> None:
    cases = _cases()
    per_rank = pool.run(parity_cases, cases, timeout_s=1800 if FULL else 240)
    for case, counts in zip(cases, per_rank[0], strict=True):
        assert counts["grads"] > 0 and counts["params"] == 2, (case, counts)
        shard = LAYOUTS[case["layout"]][1]
        assert counts["replicas"] == (2 if shard == 2 else 1), (case, counts)


# -- more of zerodp, with groups -----------------------------------------------------------------


def leaf_case(layout: str) -> list[int]:
    """Ranks route to different experts inside a leaf module; the order check is on."""
    quiet_initialize_warnings()
    torch.manual_seed(0)
    model = TwoExpertNet()
    config = hybrid_config(layout, gas=2, zero={"leaf_module": {"classes": ["TopOneBlock"]}})
    run = Lockstep(model, config, _reference_adamw, label=f"leaf, {layout}")
    choices = []
    for step in range(2):
        for micro in range(2):
            out, ref = run.forward(two_expert_inputs(run.rank, step * 2 + micro))
            choices.append(model.block.last_choice)
            run.backward((out.square().mean(), ref.square().mean()))
            if run.step():
                assert_replicas_equal(run.engine, f"leaf, {layout}")
    run.close()
    return choices


def init_case(layout: str) -> tuple[int, int]:
    """A model built under zero.Init with the engine's config is adopted in its shard groups;
    returns (shards per group, groups the engine took over as Init built them)."""
    from zerodp.stage3.init import init_groups

    quiet_initialize_warnings()
    config = hybrid_config(layout, gas=2, persistence_threshold=0)
    torch.manual_seed(0)
    reference = TinyNet()
    torch.manual_seed(0)
    with zerodp.zero.Init(config=config):
        model = TinyNet()
    built = {id(state.flat) for state in init_groups(model)}
    run = Lockstep(model, config, _reference_adamw, reference_model=reference, label="Init")
    num_shards = {state.flat.layout.world_size for state in run.engine.groups}
    adopted = sum(id(state.flat) in built for state in run.engine.groups)
    for step in range(2):
        for micro in range(2):
            out, ref = run.forward(tiny_inputs(run.rank, step * 2 + micro))
            run.backward((out.square().mean(), ref.square().mean()))
            if run.step():
                assert_replicas_equal(run.engine, "Init")
    run.close()
    (shards,) = num_shards
    return shards, adopted


def test_leaf_modules_and_zero_init_in_shard_groups(pool: WorkerPool) -> None:
    choices = pool.run(leaf_case, "stage3_shard2")
    assert choices[0] != choices[1], "the ranks of one shard group took the same expert"
    pool.run(leaf_case, "stage3_hpz2")
    shards, adopted = pool.run(init_case, "stage3_shard2")[0]
    assert shards == 2 and adopted == 3, (shards, adopted)  # Init's 3 groups kept as built


def test_a_forward_keeps_its_backward_head_only_while_one_can_come(pool: WorkerPool) -> None:
    """tests/distributed/test_backward_head.py's cases in shard groups and with hpZ."""
    for layout in ("stage3_shard2", "stage3_hpz2"):
        _, shard, hpz = LAYOUTS[layout]
        zero = {"mics_shard_size": shard, "zero_hpz_partition_size": hpz}
        if layout == "stage3_shard2":
            assert pool.run(inference_engine_case, zero) == [7] * 4
        assert pool.run(evaluation_case, None, zero) == [3] * 4, layout
        assert pool.run(uneven_drop_case, zero) == [6] * 4, layout


# -- bytes, against the formulas -----------------------------------------------------------------


def bytes_case(layout: str, gas: int) -> dict[str, Any]:
    """One step's collective bytes per group, after a warm-up step (prefetch off, nothing kept
    between passes, every parameter sharded: each module is gathered once per pass)."""
    quiet_initialize_warnings()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)
    )
    zero = {
        "stage3_prefetch_bucket_size": 0,
        "stage3_max_reuse_distance": 0,
        "reduce_bucket_size": 10_000,
    }
    config = hybrid_config(layout, gas=gas, persistence_threshold=0, zero=zero)
    engine, *_ = zerodp.initialize(model=model, config=config)
    rank = dist.get_rank()
    for step in range(2):
        if step == 1:
            engine.comm.stats.reset()
        for micro in range(gas):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank * 100 + micro))
            engine.backward(engine(x).square().mean())
            engine.step()
    measured = engine.comm.stats.group_snapshot()
    traffic = engine.comms.traffic()
    padded = sum(state.flat.padded_numel for state in engine.groups)
    engine.destroy()
    return {"measured": measured, "traffic": traffic, "padded": padded}


def test_bytes_per_step_follow_the_formulas(pool: WorkerPool) -> None:
    """Flat stage 3 crosses nodes with every gather and reduction; shard groups of 2 keep them in
    the node and cross with one all-reduce of half the gradient per step, however many
    micro-batches accumulate; hpZ 2 crosses with the first forward's gathers and the reductions."""
    across = {}
    for layout, gas in itertools.product(("stage3_flat", "stage3_shard2", "stage3_hpz2"), (1, 4)):
        result = pool.run(bytes_case, layout, gas)[0]
        _, shard, hpz = {**LAYOUTS, **FLAT}[layout]
        expected = stage3_step_bytes(
            numel=result["padded"],
            element_size=4,
            micro_batches=gas,
            world_size=4,
            shard_size=shard,
            secondary_size=hpz,
        )
        assert result["measured"] == expected.by_group(), (layout, gas, result, expected)
        assert result["traffic"]["across nodes"] == expected.across_nodes(node_size=2), result
        across[(layout, gas)] = expected.across_nodes(node_size=2)
    assert across[("stage3_shard2", 1)] == across[("stage3_shard2", 4)]
    assert across[("stage3_flat", 4)] == 4 * across[("stage3_flat", 1)] - 3 * 4  # norm once


def agreement_reach_case(layout: str, gas: int) -> list[dict[str, int]]:
    """Per micro-batch of the second step: the bytes the work and the uneven-inputs agreement
    sent within and across nodes, and the agreements made inside the shard group."""
    quiet_initialize_warnings()
    torch.manual_seed(0)
    engine, *_ = zerodp.initialize(model=TinyNet(), config=hybrid_config(layout, gas=gas))
    rank = dist.get_rank()
    reach = []
    for step in range(2):
        for micro in range(gas):
            engine.comm.stats.reset()
            local = agreement().num_local
            engine.backward(engine(tiny_inputs(rank, 10 * step + micro)).square().mean())
            engine.step()
            work, agreed = engine.comms.traffic(), engine.comms.agreement_traffic()
            reach.append(
                {
                    "work across": work.get("across nodes", 0),
                    "agreements across": agreed.get("across nodes", 0),
                    "agreements within": agreed.get("within a node", 0),
                    "local agreements": agreement().num_local - local,
                }
            )
    engine.destroy()
    return reach[gas:]


def test_micro_batches_before_the_boundary_cross_no_node(pool: WorkerPool) -> None:
    """In shard groups of 2 (4 ranks as 2 nodes of 2), a micro-batch that is not the
    accumulation boundary sends nothing across nodes: neither its gathers and reductions nor
    the uneven-inputs agreement, which agrees inside the shard group (stage 3: before its
    forward's gathers and its backward's reduce-scatter; stage 2: its backward's). The
    boundary's micro-batch agrees across nodes, before the all-reduce across shard groups."""
    for layout, per_micro in (("stage3_shard2", 2), ("stage2_shard2", 1)):
        for rank_reach in pool.run(agreement_reach_case, layout, 3):
            *before, boundary = rank_reach
            for reach in before:
                assert reach["work across"] == 0 and reach["agreements across"] == 0, reach
                assert reach["local agreements"] == per_micro, (layout, reach)
                assert reach["agreements within"] == 48 * per_micro, (layout, reach)
            assert boundary["work across"] > 0 and boundary["agreements across"] > 0, boundary


def uneven_inside_a_shard_group_case(root: str) -> tuple[str, int]:
    """Stage 3, shard groups of 2, 2 micro-batches per step: after two steps, rank 3 saves a
    checkpoint where the others run the next step's first micro-batch (which agrees inside
    the shard group only). What each rank raised, and at which micro-batch it did."""
    quiet_initialize_warnings()
    torch.manual_seed(0)
    config = hybrid_config("stage3_shard2", gas=2)
    config["comms_timeout_s"] = 60
    engine, *_ = zerodp.initialize(model=TinyNet(), config=config)
    rank = dist.get_rank()
    for micro in range(4):  # two steps: the collective order check's passes replay after them
        engine.backward(engine(tiny_inputs(rank, micro)).square().mean())
        engine.step()
    raised, where = "", -1
    try:
        if rank == 3:
            where = 0
            engine.save_checkpoint(root)
        else:
            for micro in range(2):
                where = micro
                engine.backward(engine(tiny_inputs(rank, 10 + micro)).square().mean())
                engine.step()
    except zerodp.UnevenInputsError as error:
        raised = str(error)
    finally:
        agreement().reset()
        engine.destroy()
    return raised, where


def test_uneven_inputs_inside_a_shard_group_are_named_on_every_rank(
    pool: WorkerPool, tmp_path
) -> None:
    """Rank 3 saves while its shard-group peer (rank 2) runs a micro-batch before the
    boundary: the two find it in their shard group's agreement at once and wait in the one
    over every rank, which ranks 0 and 1 (the other shard group, whose micro-batch agreed
    inside it) reach at the boundary's micro-batch: every rank raises the same error naming
    every rank, and nothing mismatched was sent (the next test runs on the same processes)."""
    results = pool.run(uneven_inside_a_shard_group_case, str(tmp_path / "ckpt"))
    messages = {message for message, _ in results}
    assert len(messages) == 1, results
    (message,) = messages
    assert "rank 3 is saving a checkpoint after 2 optimizer steps" in message, message
    assert "rank 2 is in a forward pass" in message, message
    for rank in (0, 1):  # at the boundary's micro-batch, where the world agrees
        assert f"rank {rank} is in a forward pass after 2 optimizer steps (5 micro" in message
        assert results[rank][1] == 1, results


# -- checkpoints ---------------------------------------------------------------------------------


def _full_state(engine: Any) -> dict[str, list[float]]:
    out = {}
    for name, param in engine.module.named_parameters():
        out[f"param.{name}"] = zerodp.utils.safe_get_full_fp32_param(param).reshape(-1).tolist()
        for key in ("exp_avg", "exp_avg_sq"):
            value = zerodp.utils.safe_get_full_optimizer_state(param, key)
            out[f"{key}.{name}"] = value.reshape(-1).tolist()
    return out


def save_case(path: str, layout: str) -> dict[str, Any]:
    """Train a step with shard groups, save; the shards of every key are written once."""
    quiet_initialize_warnings()
    torch.manual_seed(0)
    engine, *_ = zerodp.initialize(model=TinyNet(), config=hybrid_config(layout))
    engine.backward(engine(tiny_inputs(dist.get_rank(), 0)).square().mean())
    engine.step()
    saved = Path(engine.save_checkpoint(path, tag="t"))
    state = _full_state(engine)
    engine.destroy()
    written: dict[str, int] = {}
    if dist.get_rank() == 0:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(saved)).read_metadata()
        for key, entry in metadata.state_dict_metadata.items():
            if key.startswith(("model.", "optim.")) and entry.size:
                total = sum(chunk.sizes.numel() for chunk in entry.chunks)
                written[key] = total // entry.size.numel()
    return {"state": state, "times_written": written}


def load_case(path: str, layout: str) -> dict[str, Any]:
    quiet_initialize_warnings()
    config = hybrid_config(layout)
    torch.manual_seed(1)  # other weights than the saved ones
    engine, *_ = zerodp.initialize(model=TinyNet(), config=config)
    engine.load_checkpoint(path, tag="t")
    state = _full_state(engine)
    engine.destroy()
    return state


def window_case(path: str, save_layout: str, load_layout: str) -> dict[str, list[float]]:
    """Save between the micro-batches of a window (the kept gradients are shard-group
    averages), resume elsewhere and finish the window; returns the weights after the step."""
    quiet_initialize_warnings()
    rank = dist.get_rank()
    result = {}
    for layout, resume in ((save_layout, False), (load_layout, True)):
        torch.manual_seed(0)
        engine, *_ = zerodp.initialize(model=TinyNet(), config=hybrid_config(layout, gas=2))
        if resume:
            engine.load_checkpoint(path, tag="window")
        else:
            engine.backward(engine(tiny_inputs(rank, 0)).square().mean())
            engine.step()
            engine.save_checkpoint(path, tag="window")
        engine.backward(engine(tiny_inputs(rank, 1)).square().mean())
        engine.step()
        result[layout if not resume else f"resumed in {layout}"] = _full_state(engine)
        engine.destroy()
    return result


def test_checkpoints_between_shard_sizes_and_world_sizes(pool: WorkerPool, pools, tmp_path) -> None:
    saved = pool.run(save_case, str(tmp_path / "s2"), "stage3_shard2")[0]
    assert saved["times_written"] and set(saved["times_written"].values()) == {1}, saved
    expected = saved["state"]
    for layout in ("stage3_flat", "stage2_shard2", "stage3_hpz2"):
        assert pool.run(load_case, str(tmp_path / "s2"), layout)[0] == expected, layout
    assert pools(2).run(load_case, str(tmp_path / "s2"), "stage2_flat")[0] == expected
    hpz = pool.run(save_case, str(tmp_path / "hpz"), "stage3_hpz2")[0]
    assert pool.run(load_case, str(tmp_path / "hpz"), "stage1_shard2")[0] == hpz["state"]


def test_a_window_saved_with_shard_group_averages_resumes(pool: WorkerPool, tmp_path) -> None:
    same = pool.run(window_case, str(tmp_path / "a"), "stage2_shard2", "stage2_shard2")[0]
    assert same["stage2_shard2"] == same["resumed in stage2_shard2"]  # bitwise
    other = pool.run(window_case, str(tmp_path / "b"), "stage3_shard2", "stage2_flat")[0]
    for key, value in other["stage3_shard2"].items():
        torch.testing.assert_close(
            torch.tensor(other["resumed in stage2_flat"][key]), torch.tensor(value), msg=key
        )


# -- hpZ: the secondary shards follow every change -----------------------------------------------


def hpz_change_case(path: str, change: str) -> dict[str, int]:
    """With every secondary shard valid, change the parameters one way; the next forward must
    gather from the primary shards (across nodes) and see the change, its backward from the
    secondary ones; gradients and the step then match the reference changed alike."""
    quiet_initialize_warnings()
    torch.manual_seed(0)
    model = TinyNet()
    # Prefetch off: the backward gathers each module again (nothing kept from the forward).
    zero = {"stage3_prefetch_bucket_size": 0}
    config = hybrid_config("stage3_hpz2", persistence_threshold=0, zero=zero)
    run = Lockstep(model, config, _reference_adamw, label=f"hpZ, {change}")
    engine, rank = run.engine, run.rank
    out, ref = run.forward(tiny_inputs(rank, 0))
    run.backward((out.square().mean(), ref.square().mean()))
    run.step()
    saved: dict[str, torch.Tensor] = {}
    if change == "load":
        engine.save_checkpoint(path, tag="before")
        saved = {n: p.detach().clone() for n, p in run.ref_model.named_parameters()}
        out, ref = run.forward(tiny_inputs(rank, 1))
        run.backward((out.square().mean(), ref.square().mean()))
        run.step()  # the weights move on; the load takes them back
    with torch.no_grad():
        engine(tiny_inputs(rank, 2))  # every group gathered from the primaries once
    assert all(s.gather.gathers_from_secondary for s in engine.groups.sharded)
    new = torch.linspace(-0.3, 0.3, model.fc2.weight.numel()).view_as(model.fc2.weight)
    if change == "modifier":
        with zerodp.zero.GatheredParameters([model.fc1.weight], modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    model.fc1.weight.mul_(0.5)
    elif change == "data":
        with zerodp.zero.GatheredParameters([model.fc2.weight], modifier_rank=0):
            model.fc2.weight.data = new.clone() if rank == 0 else torch.zeros_like(new)
    elif change == "set_full":
        zerodp.utils.safe_set_full_fp32_param(model.fc2.weight, new)
    elif change == "load":
        engine.load_checkpoint(path, tag="before")
    elif change == "step":  # its backward gathers from the secondary shards, then it steps
        out, ref = run.forward(tiny_inputs(rank, 1))
        run.backward((out.square().mean(), ref.square().mean()))
        run.step()
    with torch.no_grad():
        if change == "modifier":
            run.ref_model.fc1.weight.mul_(0.5)
        elif change in ("data", "set_full"):
            run.ref_model.fc2.weight.copy_(new)
        elif change == "load":
            for name, param in run.ref_model.named_parameters():
                param.copy_(saved[name])
    still_valid = sorted(
        name for s in engine.groups.sharded if s.gather.gathers_from_secondary for name in s.names
    )
    engine.comm.stats.reset()
    out, ref = run.forward(tiny_inputs(rank, 3))
    primary = engine.comm.stats.bytes_of_group("world")
    run.backward((out.square().mean(), ref.square().mean()))  # gradients compared here
    secondary = engine.comm.stats.bytes_of_group("secondary")
    if change != "load":  # the reference's optimizer state did not go back with the load
        run.step()
    run.close()
    return {"still_valid": still_valid, "primary": primary, "secondary": secondary}


def test_hpz_secondary_shards_follow_every_change(pool: WorkerPool, tmp_path) -> None:
    changed = {"modifier": "fc1.weight", "data": "fc2.weight", "set_full": "fc2.weight"}
    for change in ("step", "modifier", "data", "set_full", "load"):
        result = pool.run(hpz_change_case, str(tmp_path / change), change)[0]
        if change in changed:  # only the changed parameter's group gathers across nodes again
            assert result["still_valid"] and changed[change] not in result["still_valid"], result
        else:
            assert result["still_valid"] == [], (change, result)
        assert result["primary"] > 0 and result["secondary"] > 0, (change, result)


class WithEmpty(nn.Module):
    """A zero-element parameter beside ordinary ones (its own group at stage 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(7, 5)
        self.empty = nn.Parameter(torch.zeros(0))
        self.tail = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(torch.tanh(self.fc(x))) + self.empty.sum()


def zero_element_case(layout: str) -> int:
    quiet_initialize_warnings()
    torch.manual_seed(0)
    config = hybrid_config(layout, gas=2, persistence_threshold=0)
    run = Lockstep(WithEmpty(), config, _reference_adamw, label=f"zero elements, {layout}")
    for step in range(2):
        for micro in range(2):
            out, ref = run.forward(tiny_inputs(run.rank, step * 2 + micro))
            run.backward((out.square().mean(), ref.square().mean()))
            if run.step():
                assert_replicas_equal(run.engine, run.label)
    run.close()
    return run.grad_comparisons


def test_zero_element_parameters_in_groups(pool: WorkerPool) -> None:
    for layout in ("stage3_hpz2", "stage3_shard2"):
        assert pool.run(zero_element_case, layout)[0] == 4


# -- sizes the nodes cannot hold: one error on every rank ----------------------------------------


def error_case(kind: str) -> str:
    rank = dist.get_rank()
    zero: dict[str, Any] = {}
    if kind == "hpz_spans_nodes":
        zero = {"zero_hpz_partition_size": 4}
    elif kind == "shard_does_not_divide":
        zero = {"mics_shard_size": 3}
    elif kind == "node_sizes_differ":
        os.environ["ZERODP_NODE_SIZE"] = "2" if rank < 2 else "4"
        zero = {"mics_shard_size": 2}
    elif kind == "not_consecutive":
        del os.environ["ZERODP_NODE_SIZE"]
        os.environ["LOCAL_WORLD_SIZE"] = "2"  # LOCAL_RANK stays the global rank
        zero = {"mics_shard_size": 2}
    config = zerodp_config(3, optimizer=ADAMW, zero=zero)
    try:
        zerodp.initialize(model=TinyNet(), config=config)
    except zerodp.ConfigError as error:
        return str(error)
    return "no error"


def test_groups_that_would_span_nodes_are_one_error_on_every_rank(pool: WorkerPool) -> None:
    expected = {
        "hpz_spans_nodes": "zero_hpz_partition_size 4 makes hpZ groups that span nodes (2 ranks "
        "per node, from ZERODP_NODE_SIZE)",
        "shard_does_not_divide": "mics_shard_size 3 does not divide the world size 4",
        "node_sizes_differ": "the ranks disagree on the ranks per node (rank 0: ZERODP_NODE_SIZE=2",
        "not_consecutive": "rank 2 has LOCAL_RANK 2, but with 2 ranks per node it would be 0",
    }
    for kind, text in expected.items():
        messages = pool.run(error_case, kind)
        assert len(set(messages)) == 1 and text in messages[0], (kind, messages)


def warning_case() -> list[str]:
    config = hybrid_config("stage3_shard2_hpz2")
    config["zero_optimization"]["mics_hierarchical_params_gather"] = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = zerodp.initialize(model=TinyNet(), config=config)
    engine.destroy()
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def test_settings_without_effect_say_so(pool: WorkerPool) -> None:
    shown = json.dumps(pool.run(warning_case)[0])
    assert "zero_hpz_partition_size 2 has no effect: the shard group has 2 ranks" in shown
    assert "mics_hierarchical_params_gather" in shown


# -- compile and the HF Trainer, with groups -----------------------------------------------------


def compile_case(layout: str) -> int:
    """torch.compile per block (aot_eager) trains bitwise like eager zerodp with the same groups."""
    from torch._dynamo.utils import counters

    from tests.models import TinyGPT, TinyGPTConfig

    quiet_initialize_warnings()
    cfg = TinyGPTConfig()
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    data = [torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=generator)] * 2
    weights = []
    for section in (None, {"enabled": True, "backend": "aot_eager", "per_block": True}):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        config = hybrid_config(layout, persistence_threshold=0)
        if section is not None:
            config["compile"] = section
        engine, *_ = zerodp.initialize(model=TinyGPT(cfg), config=config)
        for tokens in data:
            logits = engine(tokens)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            engine.backward(loss)
            engine.step()
        weights.append(_full_state(engine))
        engine.destroy()
    assert counters["stats"]["unique_graphs"] > 0, f"{layout}: nothing was compiled"
    eager, compiled = weights
    assert eager.keys() == {k.replace("_orig_mod.", "") for k in compiled}
    for name, value in compiled.items():
        assert eager[name.replace("_orig_mod.", "")] == value, f"{layout}: {name} differs"
    return len(compiled)


def test_compiled_blocks_train_like_eager_in_shard_groups(pool: WorkerPool) -> None:
    layouts = ["stage3_shard2"] + (["stage3_hpz2", "stage2_shard2"] if FULL else [])
    for layout in layouts:
        assert pool.run(compile_case, layout)[0] > 0


def trainer_case(workdir: str, layout: str) -> dict[str, list[float]]:
    from tests.hf_models import TokenDataset, build_llama
    from zerodp.integrations.transformers import ZeroDPTrainer

    quiet_initialize_warnings()
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(
        output_dir=os.path.join(workdir, layout),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    stage, shard, hpz = {**LAYOUTS, **FLAT}[layout]
    zero = {"stage": stage, "mics_shard_size": shard, "zero_hpz_partition_size": hpz}
    config = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": zero}
    trainer = ZeroDPTrainer(
        model=build_llama(), args=args, train_dataset=TokenDataset(32), zerodp_config=config
    )
    trainer.train()
    state = {
        name: zerodp.utils.safe_get_full_fp32_param(p).reshape(-1).tolist()
        for name, p in trainer.model.named_parameters()
    }
    trainer.engine.destroy()
    return state


@pytest.mark.skipif(not FULL, reason="the HF Trainer with shard groups: ZERODP_HYBRID_FULL=1")
def test_hf_trainer_with_shard_groups_trains_like_flat(pool: WorkerPool, tmp_path) -> None:
    pytest.importorskip("transformers")
    flat = pool.run(trainer_case, str(tmp_path), "stage3_flat")[0]
    for layout in ("stage3_shard2", "stage3_hpz2", "stage2_shard2"):
        hybrid = pool.run(trainer_case, str(tmp_path), layout)[0]
        for name, value in hybrid.items():
            torch.testing.assert_close(
                torch.tensor(value), torch.tensor(flat[name]), rtol=1e-5, atol=1e-6, msg=name
            )


# -- a run begun in DeepSpeed ----------------------------------------------------------------


def deepspeed_load_case(ds_stage: int, layout: str) -> dict[str, Any]:
    """DeepSpeed's own checkpoint (2 ranks) into shard groups on 4: every replica reads its
    shard; masters, moments and weights are DeepSpeed's exactly."""
    from tests import deepspeed_run as run
    from tests.distributed.test_deepspeed_checkpoints import (
        FIXTURES,
        _deviation,
        _model_weights_equal,
        expected,
    )

    want, _ = expected(ds_stage, "fp32")
    model = run.build_model()
    config = run.config(ds_stage, "fp32", 2)
    stage, shard, hpz = LAYOUTS[layout]
    zero = {"stage": stage, "mics_shard_size": shard, "zero_hpz_partition_size": hpz}
    config.update(train_micro_batch_size_per_gpu=1, zero_optimization=zero)
    engine, *_ = zerodp.initialize(
        model=model, model_parameters=run.param_groups(model), config=config
    )
    engine.load_checkpoint(str(FIXTURES / run.fixture_name(ds_stage, "fp32")))
    result = {
        "deviation": _deviation(model, want, "saved"),
        "weights_differ": _model_weights_equal(model, want),
        "replicas": assert_replicas_equal(engine, f"DeepSpeed stage {ds_stage} into {layout}"),
    }
    engine.destroy()
    return result


def test_deepspeed_checkpoints_load_into_shard_groups(pool: WorkerPool) -> None:
    for ds_stage, layout in ((3, "stage3_shard2"), (1, "stage2_shard2")):
        result = pool.run(deepspeed_load_case, ds_stage, layout)[0]
        assert result["deviation"] == {"fp32": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}, result
        assert result["weights_differ"] == [] and result["replicas"] == 2, result


# -- optimizers that read whole tensors, in shard groups -------------------------------------------


def tensorwise_cases(
    cases: list[tuple[str, str, int, bool]], save_dir: str
) -> list[dict[str, Any]]:
    """Muon + AdamW and Adafactor stepped on whole tensors inside each shard group (every
    replica steps its own copy) against the same torch optimizers on the averaged gradient
    of all 4 ranks; then the checkpoint it saves, loaded into a flat engine (one group of 4),
    holds the same weights and whole-tensor state."""
    from tests.distributed.test_tensorwise import (
        TOLERANCE,
        _max_state_error,
        _max_weight_error,
        _train,
    )
    from tests.tensorwise_setup import RECIPES, LayoutNet, newton_schulz
    from zerodp.testing import ReferenceDP

    quiet_initialize_warnings()
    results = []
    for layout, recipe_name, gas, offload in cases:
        recipe = RECIPES[recipe_name]
        stage, shard, hpz = LAYOUTS[layout]
        torch.manual_seed(0)
        reference_model = LayoutNet()
        _, recipe_config = recipe.for_engine(reference_model)
        zero: dict[str, Any] = {"mics_shard_size": shard, "zero_hpz_partition_size": hpz}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = zerodp_config(
            stage, gas=gas, optimizer=recipe_config, persistence_threshold=0, zero=zero
        )
        torch.manual_seed(0)
        model = LayoutNet()
        optimizer, _ = recipe.for_engine(model)
        with newton_schulz("fp32"):
            engine, _, _, _ = zerodp.initialize(model=model, config=config, optimizer=optimizer)
            reference = ReferenceDP(
                reference_model,
                lambda params, recipe=recipe: recipe.for_reference(list(params)),
                grad_dtype=torch.float32,
            )
            errors = _train(engine, reference, gas, 3)
            state_error, compared = _max_state_error(model, reference)
            tag = "-".join(map(str, (layout, recipe_name, gas, offload)))
            engine.save_checkpoint(save_dir, tag=tag)
            torch.manual_seed(1)
            flat_model = LayoutNet()
            flat_config = zerodp_config(
                stage, gas=gas, optimizer=recipe_config, persistence_threshold=0
            )
            flat_optimizer, _ = recipe.for_engine(flat_model)
            flat, _, _, _ = zerodp.initialize(
                model=flat_model, config=flat_config, optimizer=flat_optimizer
            )
            flat.load_checkpoint(save_dir, tag=tag)
            loaded_weights = _max_weight_error(flat_model, reference)
            loaded_state, loaded_compared = _max_state_error(flat_model, reference)
            flat.destroy()
        results.append(
            {
                "case": (layout, recipe_name, gas, offload),
                "errors": errors,
                "state_error": state_error,
                "compared": compared,
                "loaded": (loaded_weights, loaded_state, loaded_compared),
                "whole": engine.optimizer.torch_optimizers.tensorwise is not None,
                "replicas": assert_replicas_equal(engine, f"tensorwise {layout} {recipe_name}"),
                "tolerance": TOLERANCE,
            }
        )
        engine.destroy()
    return results


def test_whole_tensor_optimizers_in_shard_groups_match_one_process(
    pool: WorkerPool, tmp_path: Path
) -> None:
    cases = [
        ("stage1_shard2", "muon_list", 2, False),
        ("stage2_shard2", "adafactor", 1, True),
        ("stage3_shard2", "muon_config", 2, False),
        ("stage3_hpz2", "adafactor", 2, False),
        ("stage3_shard2_hpz2", "muon_list", 1, True),
    ]
    for result in pool.run(tensorwise_cases, cases, str(tmp_path))[0]:
        assert result["whole"], result
        assert max(result["errors"]) <= result["tolerance"], result
        assert result["compared"] > 0 and result["state_error"] <= result["tolerance"], result
        weights, state, compared = result["loaded"]
        assert weights <= result["tolerance"] and state <= result["tolerance"], result
        assert compared == result["compared"], result
        expected_replicas = 2 if LAYOUTS[result["case"][0]][1] == 2 else 1
        assert result["replicas"] == expected_replicas, result


def test_join_in_shard_groups_matches_the_reference(pool: WorkerPool) -> None:
    """Ranks with 4, 2, 3 and 1 batches under `engine.join()`, in shard groups of 2 (and hpZ)."""
    from tests.distributed.test_join import join_matches_the_reference

    quiet = {"mics_shard_size": 2, "zero_hpz_partition_size": 1}
    for stages, zero in (([1, 3], quiet), ([3], {**quiet, "zero_hpz_partition_size": 2})):
        for errors in pool.run(join_matches_the_reference, stages, zero, timeout_s=600):
            assert errors and all(error < 1e-6 for error in errors.values()), (zero, errors)
