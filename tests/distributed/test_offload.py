"""ZeRO-Offload: optimizer state and stage 3 shards on the host or in files, exact.

The reference is the same engine without offload, trained in the same process on the same
data: on the host the step does the same arithmetic in the same order (both use torch's
fused AdamW), so weights and optimizer state must be bitwise equal, in fp32 and in bf16.
(On an accelerator the host's kernels are not the device's: there the two agree within
round-off.) The data-parallel reference itself is checked elsewhere for the non-offload
engine. Memory is checked against the ZeRO-Offload figures computed in the test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerodp
import zerodp.monitor
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyNet, tiny_inputs
from zerodp.monitor import ideal_offload_bytes

ADAMW = optimizer_config("AdamW", lr=1e-2, weight_decay=0.01, fused=True)


def _offload(stage: int, where: str, nvme: str | None, ratio: float = 1.0) -> dict[str, Any]:
    if where == "none":
        return {}
    device = "nvme" if where == "nvme" else "cpu"
    zero: dict[str, Any] = {
        "offload_optimizer": {"device": device, "nvme_path": nvme, "ratio": ratio}
    }
    if stage == 3:
        zero["offload_param"] = {"device": device, "nvme_path": nvme}
    return zero


def _config(
    stage: int, dtype: str, where: str, nvme: str | None, ratio: float = 1.0, gas: int = 2
) -> dict:
    return zerodp_config(
        stage,
        gas=gas,
        optimizer=ADAMW,
        clipping=0.05,
        dtype=dtype,
        persistence_threshold=0,
        zero=_offload(stage, where, nvme, ratio),
    )


def _train(engine: zerodp.ZeroEngine, micro_steps: int, start: int = 0) -> None:
    rank = dist.get_rank()
    for micro in range(start, start + micro_steps):
        engine.backward(engine(tiny_inputs(rank, micro)).float().square().mean())
        engine.step()


def _snapshot(engine: zerodp.ZeroEngine, model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for param in model.parameters():
        out.append(zerodp.utils.safe_get_full_fp32_param(param))
        for key in ("exp_avg", "exp_avg_sq"):
            out.append(zerodp.utils.safe_get_full_optimizer_state(param, key))
    out.append(torch.tensor([engine.global_steps, engine.micro_steps]))
    return out


def _run(stage: int, dtype: str, where: str, nvme: str | None, ratio: float = 1.0) -> tuple:
    torch.manual_seed(0)
    model = TinyNet()
    engine, _, _, _ = zerodp.initialize(
        model=model, config=_config(stage, dtype, where, nvme, ratio)
    )
    _train(engine, 20)  # 10 optimizer steps
    snapshot = _snapshot(engine, model)
    files = sorted(p.name for p in Path(nvme).rglob("*.bin")) if nvme else []
    memory = engine.model_state_bytes()
    engine.destroy()
    leftover = sorted(p.name for p in Path(nvme).rglob("*")) if nvme else []
    return snapshot, files, memory, leftover


def offload_is_exact(stage: int, dtype: str, nvme_root: str) -> dict:
    plain, _, plain_memory, _ = _run(stage, dtype, "none", None)
    report = {}
    cases = {"cpu": (None, 1.0), "nvme": (f"{nvme_root}/rank{dist.get_rank()}", 1.0)}
    if stage == 2:
        cases["cpu_half"] = (None, 0.5)  # partial offload: half the elements on the host
    for name, (nvme, ratio) in cases.items():
        where = "nvme" if name == "nvme" else "cpu"
        snapshot, files, memory, leftover = _run(stage, dtype, where, nvme, ratio)
        for a, b in zip(plain, snapshot, strict=True):
            assert torch.equal(a, b), f"stage {stage} {dtype} {name}: differs from no offload"
        report[name] = {"files": files, "leftover": leftover, "memory": memory}
    report["none"] = {"memory": plain_memory}
    return report


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_is_bitwise_equal_to_no_offload(pools, tmp_path, stage: int, dtype: str) -> None:
    reports = pools(2).run(offload_is_exact, stage, dtype, str(tmp_path), timeout_s=240)
    for report in reports:
        nvme = report["nvme"]
        assert any(name.endswith(".copy.bin") for name in nvme["files"]), nvme["files"]
        assert any("exp_avg" in name for name in nvme["files"]), nvme["files"]
        if stage == 3:
            assert any(name.endswith(".shard.bin") for name in nvme["files"]), nvme["files"]
        assert nvme["leftover"] == [], "destroy() removes the offload files"


def offloaded_memory() -> zerodp.monitor.ModelStateBytes:
    torch.manual_seed(0)
    model = TinyNet()
    config = _config(3, "bf16", "cpu", None, gas=1)  # one micro-batch: bf16 kept gradients
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    _train(engine, 2)
    memory = engine.model_state_bytes()
    engine.destroy()
    return memory


def test_offload_memory_follows_the_zero_offload_figures(pools) -> None:
    psi = sum(p.numel() for p in TinyNet().parameters())  # 170: even, no padding at 2 ranks
    for memory in pools(2).run(offloaded_memory):
        device, host = ideal_offload_bytes(psi, 3, 2, mixed=True, offload_params=True)
        # Device: the kept bf16 gradient shard only (parameters are gathered on use).
        assert memory.device_total == device, (memory, device)
        # Host: the bf16 shard, the fp32 master and Adam's moments (12 bytes / N each)
        # plus AdamW's `step` counter per group; gradient buffers are counted apart.
        steps = memory.host_optimizer - 12 * psi // 2
        assert 0 <= steps <= 8 * 8, memory
        assert memory.host_params + memory.host_optimizer - steps == host, (memory, host)
        assert memory.host_grads > 0


# -- checkpoints: the format does not change with offload ----------------------------------


def save_with(stage: int, where: str, directory: str, nvme: str | None) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    engine, _, _, _ = zerodp.initialize(model=model, config=_config(stage, "fp32", where, nvme))
    _train(engine, 6)
    engine.save_checkpoint(directory, tag="mid")
    engine.destroy()


def load_with(stage: int, where: str, directory: str, nvme: str | None) -> list[torch.Tensor]:
    torch.manual_seed(1)  # different initial weights: everything must come from the checkpoint
    model = TinyNet()
    engine, _, _, _ = zerodp.initialize(model=model, config=_config(stage, "fp32", where, nvme))
    engine.load_checkpoint(directory, tag="mid")
    _train(engine, 6, start=6)
    snapshot = _snapshot(engine, model)
    engine.destroy()
    return snapshot


def straight(stage: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = TinyNet()
    engine, _, _, _ = zerodp.initialize(model=model, config=_config(stage, "fp32", "none", None))
    _train(engine, 12)
    snapshot = _snapshot(engine, model)
    engine.destroy()
    return snapshot


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoints_move_between_offload_and_no_offload(pools, tmp_path, stage: int) -> None:
    """Saved with offload, loaded without, and the reverse: the same as never stopping."""
    expected = pools(2).run(straight, stage)
    nvme = str(tmp_path / "nvme")
    for saved, loaded in (("cpu", "none"), ("none", "nvme"), ("nvme", "cpu")):
        directory = str(tmp_path / f"{saved}-{loaded}")
        pools(2).run(save_with, stage, saved, directory, nvme)
        resumed = pools(2).run(load_with, stage, loaded, directory, nvme)
        for rank in range(2):
            for a, b in zip(expected[rank], resumed[rank], strict=True):
                assert torch.equal(a, b), (saved, loaded, rank)


# -- bad input -------------------------------------------------------------------------


def bad_nvme_paths(tmp: str) -> list[str]:
    messages = []
    rank = dist.get_rank()
    for nvme in ("/sys/zerodp-offload" if rank == 1 else tmp, "/proc/zerodp"):
        torch.manual_seed(0)
        with pytest.raises(zerodp.ConfigError, match="nvme_path") as error:
            zerodp.initialize(model=TinyNet(), config=_config(2, "fp32", "nvme", nvme))
        messages.append(str(error.value))
    from zerodp.offload import setup

    original = setup.free_bytes
    setup.free_bytes = lambda path: 0  # a full disk
    try:
        with pytest.raises(zerodp.ConfigError, match="MiB free") as error:
            zerodp.initialize(model=TinyNet(), config=_config(2, "fp32", "nvme", tmp))
        messages.append(str(error.value))
    finally:
        setup.free_bytes = original
    torch.manual_seed(0)
    engine, _, _, _ = zerodp.initialize(model=TinyNet(), config=_config(2, "fp32", "nvme", tmp))
    _train(engine, 2)  # a good path still trains afterwards: no rank was left waiting
    engine.destroy()
    return messages


def test_bad_nvme_paths_are_refused_on_every_rank(pools, tmp_path) -> None:
    per_rank = pools(2).run(bad_nvme_paths, str(tmp_path), timeout_s=120)
    assert per_rank[0] == per_rank[1]
    assert "rank 1" in per_rank[0][0] and "not writable" in per_rank[0][0]
