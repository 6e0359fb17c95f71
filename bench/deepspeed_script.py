"""One DeepSpeed training script under DeepSpeed and under zerodp: the losses, step by step.

    OMP_NUM_THREADS=1 python bench/deepspeed_script.py [--stages 2] [--variants ...]

The script is `tests/data/deepspeed_script/train.py`, written for DeepSpeed. It is
launched the DeepSpeed way twice, from the same initial weights and data:

    deepspeed  --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json ...
    zerodp run --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json ...

the second time with only its `deepspeed` imports rewritten to `zerodp` ones (the
rewrite of tests/distributed/test_deepspeed_script.py). Each run writes the loss
of every micro-step, averaged over the ranks; the table shows both, whether they
are bitwise equal, and the largest relative difference. Variants change the
config: "as_shipped" is the script's own config (no weight_decay and no
gradient_clipping written, so DeepSpeed's defaults apply), "explicit" writes
DeepSpeed's defaults out (weight_decay 0.01, gradient_clipping 1.0),
"no_clipping" sets gradient_clipping 0, and "old_defaults" gives DeepSpeed the
script's config and zerodp the values zerodp assumed before it followed DeepSpeed
0.19.8 (weight_decay 0, gradient_clipping 0): the drift a user saw.

On a machine without GPUs DeepSpeed runs with DS_ACCELERATOR=cpu; its first launch
compiles DeepSpeed's CPU shared-memory comm op (minutes; cached afterwards under
~/.cache/torch_extensions). Without DeepSpeed installed, its column says so
(`pip install deepspeed==0.19.8`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.distributed.test_deepspeed_script import (  # noqa: E402
    SCRIPT_DIR,
    load_parts,
    rewrite_imports,
)

WORLD_SIZE = 2
VARIANTS = ("as_shipped", "explicit", "no_clipping", "old_defaults")
TIMEOUT_S = 1800


def variant_config(base: dict[str, Any], variant: str, stage: int, engine: str) -> dict[str, Any]:
    config = copy.deepcopy(base)
    config["zero_optimization"] = {"stage": stage}
    if variant == "old_defaults" and engine == "zerodp":
        config["optimizer"]["params"]["weight_decay"] = 0.0
        config["gradient_clipping"] = 0.0
    if variant == "explicit":
        config["optimizer"]["params"]["weight_decay"] = 0.01
        config["gradient_clipping"] = 1.0
    elif variant == "no_clipping":
        config["gradient_clipping"] = 0.0
    return config


def deepspeed_command() -> list[str] | None:
    launcher = Path(sys.executable).parent / "deepspeed"
    if launcher.is_file():
        return [str(launcher)]
    found = shutil.which("deepspeed")
    return [found] if found else None


def run(folder: Path, engine: str, config: dict[str, Any]) -> tuple[list[float] | None, str]:
    """Launch train.py for `engine` in `folder`; (losses, "" or why there are none)."""
    folder.mkdir(parents=True)
    shutil.copy(SCRIPT_DIR / "script_parts.py", folder / "script_parts.py")
    source = (SCRIPT_DIR / "train.py").read_text()
    (folder / "train.py").write_text(rewrite_imports(source) if engine == "zerodp" else source)
    (folder / "ds_config.json").write_text(json.dumps(config))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if engine == "deepspeed":
        launcher = deepspeed_command()
        if launcher is None:
            return None, "not run: pip install deepspeed==0.19.8"
        env.setdefault("DS_ACCELERATOR", "cpu" if not _has_gpu() else "cuda")
    else:
        launcher = [sys.executable, "-m", "zerodp.launch.cli", "run"]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    command = [
        *launcher,
        *("--num_gpus", str(WORLD_SIZE), "train.py", "--deepspeed"),
        *("--deepspeed_config", "ds_config.json", "--losses", "losses.json"),
        *("--save_dir", "checkpoints"),
    ]
    done = subprocess.run(
        command, cwd=folder, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        return None, f"exit {done.returncode}: " + " | ".join(tail)
    return json.loads((folder / "losses.json").read_text())["losses"], ""


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def report(variant: str, stage: int, ds: list[float] | None, zd: list[float] | None) -> None:
    print(f"\n{variant}, ZeRO stage {stage}")
    if ds is None or zd is None:
        return
    print(f"{'micro-step':>10}  {'DeepSpeed':>22}  {'zerodp':>22}  bitwise")
    for step, (a, b) in enumerate(zip(ds, zd, strict=True)):
        print(f"{step:>10}  {a!r:>22}  {b!r:>22}  {'yes' if a == b else 'no'}")
    worst = max(abs(a - b) / abs(a) for a, b in zip(ds, zd, strict=True))
    equal = sum(a == b for a, b in zip(ds, zd, strict=True))
    print(f"bitwise equal: {equal}/{len(ds)} micro-steps; largest relative difference {worst:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2], choices=[0, 1, 2, 3])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args()
    base = load_parts().CONFIG
    with tempfile.TemporaryDirectory() as scratch:
        for variant in args.variants:
            for stage in args.stages:
                where = Path(scratch) / f"{variant}_{stage}"
                ds_config = variant_config(base, variant, stage, "deepspeed")
                ds, ds_note = run(where / "deepspeed", "deepspeed", ds_config)
                zd_config = variant_config(base, variant, stage, "zerodp")
                zd, zd_note = run(where / "zerodp", "zerodp", zd_config)
                report(variant, stage, ds, zd)
                for name, note in (("DeepSpeed", ds_note), ("zerodp", zd_note)):
                    if note:
                        print(f"{name}: {note}")


if __name__ == "__main__":
    main()
