"""The DeepSpeed checkpoint reader's parts, without processes: unpickling, format, layout.

The layouts are checked against the fixtures DeepSpeed 0.19.8 wrote
(tests/data/deepspeed_checkpoints): each parameter's fragments, read with the
layout, must give DeepSpeed's own fp32 master of it (recorded through
DeepSpeed's accessor at the save).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import deepspeed_run as run
from zerodp.checkpoint_io.deepspeed.files import DeepSpeedFormat, find_checkpoint
from zerodp.checkpoint_io.deepspeed.layout import DeepSpeedLayout, Fragment
from zerodp.checkpoint_io.deepspeed.records import read_model_states
from zerodp.checkpoint_io.deepspeed.sources import Wanted, open_source
from zerodp.checkpoint_io.deepspeed.unpickle import DynamicLossScalerRecord, read_pickle
from zerodp.errors import CheckpointError
from zerodp.precision.loss_scaler import LossScaler

FIXTURES = Path(__file__).resolve().parents[1] / "data/deepspeed_checkpoints"


# -- unpickling ------------------------------------------------------------------------------


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_a_planted_reduce_is_refused_before_it_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    torch.save({"module": {"w": torch.ones(2)}, "args": _Payload(marker)}, path)
    with pytest.raises(CheckpointError, match=r"refused: it asks to build 'posix\.system'"):
        read_pickle(path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the payload is live: an unrestricted load runs it
    assert marker.exists()


def _fake_deepspeed_class(name: str) -> tuple[type, list[str]]:
    """A class pickled under DeepSpeed's loss-scaler name (no DeepSpeed installed needed)."""
    module_name = "deepspeed.runtime.fp16.loss_scaler"
    added = []
    for part in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16", module_name):
        if part not in sys.modules:
            sys.modules[part] = types.ModuleType(part)
            added.append(part)
    cls = type(name, (), {"__module__": module_name})
    setattr(sys.modules[module_name], name, cls)
    return cls, added


def test_deepspeed_records_keep_plain_fields_only(tmp_path: Path) -> None:
    cls, added = _fake_deepspeed_class("DynamicLossScaler")
    try:
        good, bad = cls(), cls()
        good.__dict__.update(cur_scale=512.0, cur_iter=3, dtype=torch.float16)
        bad.__dict__.update(cur_scale=512.0, hook=[1, 2])
        torch.save({"loss_scaler": good}, tmp_path / "good.pt")
        torch.save({"loss_scaler": bad}, tmp_path / "bad.pt")
    finally:
        for name in reversed(added):
            del sys.modules[name]
    record = read_pickle(tmp_path / "good.pt")["loss_scaler"]
    assert isinstance(record, DynamicLossScalerRecord)
    assert record.fields == {"cur_scale": 512.0, "cur_iter": 3, "dtype": torch.float16}
    with pytest.raises(CheckpointError, match=r"refused: DynamicLossScaler field 'hook' holds a"):
        read_pickle(tmp_path / "bad.pt")


def test_a_damaged_file_names_itself(tmp_path: Path) -> None:
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path.write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=str(path)):
        read_pickle(path)


# -- format detection ------------------------------------------------------------------------


def test_formats_are_recognised_from_the_files(tmp_path: Path) -> None:
    found = find_checkpoint(FIXTURES / "stage2_fp16", None)
    assert found is not None and found.format is DeepSpeedFormat.ZERO
    assert found.world_size == 2 and found.folder.name == "global_step3"
    stage3 = find_checkpoint(FIXTURES / "stage3_fp32" / "global_step3", None)  # the tag folder
    assert stage3 is not None and stage3.format is DeepSpeedFormat.ZERO3
    universal = find_checkpoint(FIXTURES / "stage3_bf16", "global_step3_universal")
    assert universal is not None and universal.format is DeepSpeedFormat.UNIVERSAL
    assert find_checkpoint(tmp_path, None) is None  # empty: not DeepSpeed's
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "zerodp_state.json").write_text("{}")
    assert find_checkpoint(tmp_path, "t") is None  # zerodp's own


def test_load_universal_reads_latest_universal_first(tmp_path: Path) -> None:
    """`checkpoint.load_universal` (DeepSpeed's key): with no tag, `latest_universal` is read
    before `latest`; either alone is read whatever the setting."""
    both = FIXTURES / "stage2_fp32"  # ds_to_universal's output beside the ZeRO checkpoint
    for prefer, expected in ((False, DeepSpeedFormat.ZERO), (True, DeepSpeedFormat.UNIVERSAL)):
        found = find_checkpoint(both, None, prefer_universal=prefer)
        assert found is not None and found.format is expected, prefer
    only_zero = tmp_path / "zero"
    shutil.copytree(both / "global_step3", only_zero / "global_step3")
    (only_zero / "latest").write_text("global_step3")
    found = find_checkpoint(only_zero, None, prefer_universal=True)
    assert found is not None and found.format is DeepSpeedFormat.ZERO


def test_model_parallel_and_incomplete_folders_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "global_step3"
    shutil.copytree(FIXTURES / "stage1_fp32" / "global_step3", folder)
    shutil.copy(
        folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        folder / "zero_pp_rank_0_mp_rank_01_optim_states.pt",
    )
    with pytest.raises(CheckpointError, match="model-parallel"):
        find_checkpoint(folder, None)
    (folder / "zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink()
    (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"lacks the files of ranks \[0\]"):
        find_checkpoint(folder, None)


# -- layout ----------------------------------------------------------------------------------


def test_stage12_layout_splits_straddling_parameters_and_skips_alignment_gaps() -> None:
    # Two parameters of 5 and 4 elements, a 3-element gap after the first, 2 ranks of 6.
    layout = DeepSpeedLayout.stage12([[("a", 5), ("b", 4)]], 2, [6], [[3, 0]])
    assert layout.fragments("a") == [Fragment(0, 0, 0, 0, 5)]
    assert layout.fragments("b") == [Fragment(1, 0, 2, 0, 4)]  # starts at 8 = 6 + 2
    straddling = DeepSpeedLayout.stage12([[("a", 5), ("b", 4)]], 3, [3], None)
    assert straddling.fragments("a") == [Fragment(0, 0, 0, 0, 3), Fragment(1, 0, 0, 3, 2)]
    assert straddling.fragments("b") == [Fragment(1, 0, 2, 0, 1), Fragment(2, 0, 0, 1, 3)]
    with pytest.raises(CheckpointError, match="hold only"):
        DeepSpeedLayout.stage12([[("a", 5), ("b", 4)]], 2, [4], None)


def test_stage3_layout_partitions_each_parameter() -> None:
    layout = DeepSpeedLayout.stage3([[("a", 5), ("b", 2)]], 3)
    assert layout.fragments("a") == [
        Fragment(0, 0, 0, 0, 2),
        Fragment(1, 0, 0, 2, 2),
        Fragment(2, 0, 0, 4, 1),
    ]
    assert layout.fragments("b") == [Fragment(0, 0, 2, 0, 1), Fragment(1, 0, 2, 1, 1)]
    with pytest.raises(CheckpointError, match="do not belong together"):
        layout.check_against(0, [2], "rank 0's file")


@pytest.mark.parametrize(
    "fixture",
    [
        *(run.fixture_name(s, p) for s in run.STAGES for p in run.PRECISIONS),
        "stage2_fp32/global_step3_universal",
    ],
)
def test_masters_read_through_the_layout_are_deepspeed_s_own(fixture: str) -> None:
    from safetensors.torch import load_file

    name, _, tag = fixture.partition("/")
    files = find_checkpoint(FIXTURES / name, tag or None)
    assert files is not None
    model = read_model_states(files.model_files[0])
    source = open_source(files, model)
    wanted = [
        Wanted(n, 0, int(torch.Size(s).numel()), {"fp32": torch.empty(torch.Size(s).numel())})
        for n, s in model.trainable_shapes.items()
    ]
    source.fill(wanted)
    expected = load_file(str(FIXTURES / name / "expected.safetensors"))
    for item in wanted:
        assert torch.equal(
            item.destinations["fp32"], expected[f"saved.fp32.{item.name}"].reshape(-1)
        )
    assert source.optimizer.steps == dict.fromkeys(model.trainable_shapes, run.SAVED_AT)


# -- the loss scale, as DeepSpeed's DynamicLossScaler moves it ---------------------------------


def test_loss_scale_doubles_when_deepspeed_s_does() -> None:
    """Window 2: DeepSpeed doubles at clean steps 3, 5, 7, ...; after an overflow the count
    restarts (hysteresis 2: the first overflow only spends the budget)."""
    scaler = LossScaler(scale=256.0, dynamic=True, window=2, hysteresis=2)
    seen = []
    for overflow in [False] * 6 + [True] + [False] * 4:
        scaler.update(overflow)
        seen.append(scaler.scale)
    assert seen == [256, 256, 512, 512, 1024, 1024, 1024, 1024, 1024, 2048, 2048]
    for stage in run.STAGES:  # DeepSpeed's own scale after each of its 6 steps
        after = _record(run.fixture_name(stage, "fp16"))["loss_scales_after"]
        scaler = LossScaler(scale=256.0, dynamic=True, window=2, hysteresis=2)
        mine = []
        for _ in after:
            scaler.update(False)
            mine.append(scaler.scale)
        assert mine == after


def _record(fixture: str) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(FIXTURES / fixture / "expected.safetensors"), "pt") as file:
        return json.loads(file.metadata()["record"])
