"""A DeepSpeed training script runs on zerodp with only its imports changed.

`tests/data/deepspeed_script/train.py` is written for DeepSpeed (argparse with
`add_config_arguments`, `init_distributed`, `initialize(args=...)`,
`get_accelerator()`, `deepspeed.comm` calls, a training loop over the engine's
data loader, `save_checkpoint` with client state and `load_checkpoint`). The
test rewrites its `deepspeed` imports to `zerodp` ones and nothing else,
launches it the DeepSpeed way (`zerodp run --num_gpus 2 train.py --deepspeed
--deepspeed_config ...`), and compares its losses with a reference computed
here: the same model, data order and DeepSpeed 0.19.8's defaults for this
config (torch's AdamW with its weight decay 0.01, gradient clipping at 1.0),
as plain data parallelism in one process. Two more references, each without one
of those defaults, must differ from the run: the test sees each default.

DeepSpeed itself is not run here (`python bench/deepspeed_script.py` runs the
same script under DeepSpeed 0.19.8 and zerodp and compares them step by step): its
CPU backend compiles a C++ op on first use (minutes), and each of its 2-rank launches
takes about 50 s. It is installed (the test extras hold it), so a `deepspeed` import
the rewrite missed would run DeepSpeed's code unnoticed: none may be left.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch.utils.data import DistributedSampler

SCRIPT_DIR = Path(__file__).resolve().parents[1] / "data" / "deepspeed_script"
WORLD_SIZE = 2
DEEPSPEED_CLIPPING = 1.0  # gradient_clipping when the config leaves it out (DeepSpeed 0.19.3+)
ROOT = Path(__file__).resolve().parents[2]


def rewrite_imports(source: str) -> str:
    """`import deepspeed` -> `import zerodp as deepspeed`, `deepspeed.x` -> `zerodp.x` in
    import statements; every other line stays as it is."""
    source = re.sub(r"^(\s*)import deepspeed$", r"\1import zerodp as deepspeed", source, flags=re.M)
    source = re.sub(
        r"^(\s*)import deepspeed\.(\S+) as ", r"\1import zerodp.\2 as ", source, flags=re.M
    )
    return re.sub(r"^(\s*)from deepspeed([. ])", r"\1from zerodp\2", source, flags=re.M)


def load_parts() -> ModuleType:
    spec = importlib.util.spec_from_file_location("script_parts", SCRIPT_DIR / "script_parts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rewrite_changes_only_import_lines() -> None:
    original = (SCRIPT_DIR / "train.py").read_text()
    rewritten = rewrite_imports(original)
    changed = [
        line[1:]
        for line in difflib.unified_diff(original.splitlines(), rewritten.splitlines(), n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert changed, "the script has no deepspeed import to rewrite"
    assert all(line.startswith(("import ", "from ")) for line in changed), changed
    left = re.findall(r"^\s*(?:import|from)\s+deepspeed\b.*$", rewritten, flags=re.M)
    assert not left, left
    assert "deepspeed." in rewritten  # calls such as deepspeed.initialize stay as they are


def reference_losses(
    parts: ModuleType, *, weight_decay: float | None, clipping: float
) -> list[float]:
    """The script's run as plain data parallelism in one process (see the module docstring).

    Each rank's micro-batches come from the sampler DeepSpeed's and zerodp's loaders use
    (DistributedSampler, shuffled with seed 0); each rank's loss is divided by the
    accumulation steps and the ranks' gradients averaged; at each boundary the global
    norm is clipped and torch's AdamW (the class `torch_adam` builds) steps.
    """
    config = parts.CONFIG
    micro, gas = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    torch.manual_seed(parts.INIT_SEED)
    model = parts.TinyNet()
    kwargs = {} if weight_decay is None else {"weight_decay": weight_decay}
    optimizer = torch.optim.AdamW(model.parameters(), lr=parts.LR, **kwargs)
    data = parts.SyntheticData()
    batches = []
    for rank in range(WORLD_SIZE):
        order = list(DistributedSampler(data, num_replicas=WORLD_SIZE, rank=rank, seed=0))
        batches.append([order[i : i + micro] for i in range(0, len(order), micro)])
    losses = []
    for index, per_rank in enumerate(zip(*batches, strict=True)):
        rank_losses = []
        for indices in per_rank:
            features, labels = data.features[indices], data.labels[indices]
            loss = torch.nn.functional.cross_entropy(model(features), labels)
            (loss / (gas * WORLD_SIZE)).backward()
            rank_losses.append(loss.detach())
        losses.append(torch.stack(rank_losses).sum().item() / WORLD_SIZE)
        if (index + 1) % gas == 0:
            if clipping > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clipping)
            optimizer.step()
            optimizer.zero_grad()
    return losses


def run_script(tmp_path: Path) -> dict[str, object]:
    """Launch the rewritten script as DeepSpeed's users launch theirs; its losses file."""
    parts_copy = tmp_path / "script_parts.py"
    shutil.copy(SCRIPT_DIR / "script_parts.py", parts_copy)
    (tmp_path / "train.py").write_text(rewrite_imports((SCRIPT_DIR / "train.py").read_text()))
    (tmp_path / "ds_config.json").write_text(json.dumps(load_parts().CONFIG))
    command = [
        *(sys.executable, "-m", "zerodp.launch.cli", "run", "--num_gpus", str(WORLD_SIZE)),
        *("train.py", "--deepspeed", "--deepspeed_config", "ds_config.json"),
        *("--losses", "losses.json", "--save_dir", "checkpoints"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZERODP_DEVICE": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return json.loads((tmp_path / "losses.json").read_text())


def test_deepspeed_script_runs_with_only_its_imports_changed(tmp_path: Path) -> None:
    parts = load_parts()
    result = run_script(tmp_path)
    losses = torch.tensor(result["losses"], dtype=torch.float64)
    expected = reference_losses(parts, weight_decay=None, clipping=DEEPSPEED_CLIPPING)
    assert result["global_steps"] == len(expected) // parts.CONFIG["gradient_accumulation_steps"]
    # fp32 round-off only: the ranks' sums and the clipping norm are added up in another order.
    torch.testing.assert_close(
        losses, torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0
    )
    assert (tmp_path / "checkpoints" / "latest").is_file()
    # Each DeepSpeed default shows in these losses: without it, the reference differs.
    for name, other in (
        ("weight_decay 0", reference_losses(parts, weight_decay=0.0, clipping=DEEPSPEED_CLIPPING)),
        ("no clipping", reference_losses(parts, weight_decay=None, clipping=0.0)),
    ):
        gap = ((losses - torch.tensor(other, dtype=torch.float64)) / losses).abs().max().item()
        assert gap > 2e-5, f"the run cannot tell DeepSpeed's defaults from {name}"
