"""The Accelerate recipe of docs/integrations.md, run as written, against Accelerate alone.

The recipe's code block is read from the docs and executed, so the docs cannot
drift from what is tested. On 2 ranks it trains with zerodp (Accelerate
prepares only the data loader); the reference is Accelerate's own
single-process loop (`accelerator.prepare(model, optimizer, loader)`,
`accelerator.backward`, `clip_grad_norm_`) with twice the batch and the same
seedable sampler, so its step k sees the samples of both ranks' step k. fp32:
the bound is round-off (1e-5, 1% of one AdamW step). AdamW hardly sees a
constant factor on the gradients (nor does clipping), so stage 3 also runs
with SGD with momentum and no clipping, whose weights show a wrong loss scale.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_models import TokenDataset, build_llama, detached, max_abs_difference

pytest.importorskip("accelerate")

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
WORLD = 2
MICRO = 2
GAS = 2
LR = 1e-3
CLIP = 0.5
NUM_SAMPLES = 32  # 4 optimizer steps
BOUND = 1e-5


def fresh_accelerate_state() -> None:
    """Forget an earlier test's Accelerator in this process (its mixed precision would stay)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def recipe() -> Any:
    """The `train` function of the docs' recipe block."""
    text = DOCS.read_text()
    marker = text.index("<!-- accelerate-recipe:")
    block = re.search(r"```python\n(.*?)```", text[marker:], re.S)
    assert block is not None, "the recipe's code block is missing from docs/integrations.md"
    namespace: dict[str, Any] = {}
    exec(compile(block.group(1), str(DOCS), "exec"), namespace)
    return namespace["train"]


OPTIMIZERS = {  # class, settings, clipping threshold
    "AdamW": (torch.optim.AdamW, {"lr": LR, "weight_decay": 0.1}, CLIP),
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 0.0),
}
CASES = [(1, "AdamW"), (2, "AdamW"), (3, "AdamW"), (3, "SGD")]


def config(stage: int, optimizer: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": OPTIMIZERS[optimizer][2],
        "optimizer": {"type": optimizer, "params": OPTIMIZERS[optimizer][1]},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def recipe_cases(cases: list[tuple[int, str]]) -> dict[Any, dict[str, torch.Tensor]]:
    import torch.distributed as dist

    from zerodp.utils import safe_get_full_fp32_param

    train = recipe()
    results = {}
    for stage, optimizer in cases:
        fresh_accelerate_state()
        model = build_llama()
        engine = train(model, TokenDataset(NUM_SAMPLES), config(stage, optimizer))
        assert engine.global_steps == NUM_SAMPLES // (MICRO * GAS * WORLD)
        params = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
        results[stage, optimizer] = params
        engine.destroy()
    return results if dist.get_rank() == 0 else {}


def accelerate_alone(optimizer_name: str) -> dict[str, torch.Tensor]:
    """Accelerate's own single-process training of the same run."""
    from accelerate import Accelerator, DataLoaderConfiguration

    fresh_accelerate_state()
    model = build_llama()
    accelerator = Accelerator(
        mixed_precision="no",
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0),
    )
    cls, kwargs, clip = OPTIMIZERS[optimizer_name]
    optimizer = cls(model.parameters(), **kwargs)
    loader = torch.utils.data.DataLoader(
        TokenDataset(NUM_SAMPLES), batch_size=MICRO * WORLD, shuffle=True
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loader.set_epoch(0)
    for index, batch in enumerate(loader):
        accelerator.backward(model(**batch).loss / GAS)
        if (index + 1) % GAS == 0:
            if clip > 0:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return detached(accelerator.unwrap_model(model).named_parameters())


def test_accelerate_recipe_matches_accelerate_alone(pools) -> None:
    got = pools(WORLD).run(recipe_cases, CASES, timeout_s=180)[0]
    expected = {name: accelerate_alone(name) for name in OPTIMIZERS}
    lines = ["", "| Accelerate recipe | max weight diff after 4 steps | where |", "|---|---|---|"]
    for stage, optimizer in CASES:
        diff, where = max_abs_difference(got[stage, optimizer], expected[optimizer])
        lines.append(f"| stage {stage}, {optimizer} | {diff:.2e} | {where} |")
        assert diff <= BOUND, (stage, optimizer, diff, where)
    print("\n".join(lines))
