"""Tiled compute on a Hugging Face model in one process, against the same model untiled.

The engine's cases (stages 0-3, sequence parallelism, uneven lengths) are in
tests/distributed/test_tiled_compute.py; here the switch itself (`TiledCompute`, with no
engine hooks): the loss and every gradient equal the untiled model's (fp32, 1e-5) for the
MLPs and the loss tiled together and alone, at tile sizes that do and do not divide the
sequence; no tensor as wide as the vocabulary (or the MLP's intermediate size) ever has
more rows than one tile's; a forward without autograd is untiled and returns its logits;
`remove()` puts every forward back; and what it cannot tile exactly is refused.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.hf_models import HIDDEN, VOCAB, build_llama
from zerodp.config import load_config
from zerodp.errors import ConfigError, UsageError
from zerodp.sequence import TiledCompute, TilingSettings

pytest.importorskip("transformers")

INTERMEDIATE = 64  # tests.hf_models' Llama
ROWS, LENGTH = 2, 29


class WidestRows(TorchDispatchMode):
    """For each last-dimension size, the most rows any tensor an operation produced had."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2:
                width = int(tensor.shape[-1])
                self.rows[width] = max(self.rows.get(width, 0), tensor.numel() // max(width, 1))
        return out


def inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (ROWS, LENGTH), generator=generator)
    labels = ids.clone()
    labels[0, :7] = -100  # a masked prompt
    return {"input_ids": ids, "labels": labels}


def train_step(model: torch.nn.Module, rows: WidestRows | None = None) -> torch.Tensor:
    if rows is None:
        out = model(**inputs())
        out.loss.backward()
    else:
        with rows:
            out = model(**inputs())
            out.loss.backward()
    return out


@pytest.mark.parametrize(
    ("mlp", "logits", "tile"),
    [(True, True, 3), (True, False, 4), (False, True, 1), (True, True, 0)],
)
def test_loss_and_gradients_equal_the_untiled_model(mlp: bool, logits: bool, tile: int) -> None:
    model = build_llama(0)
    reference = copy.deepcopy(model)
    tiling = TiledCompute(model, TilingSettings(mlp, logits, tile), [])
    out = train_step(model)
    expected = train_step(reference)
    assert (out.logits is None) == logits
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
    assert tiling.tile == (tile or HIDDEN)
    tiling.remove()


def test_no_tensor_holds_more_than_one_tile_of_logits_or_intermediates() -> None:
    tile = 3
    untiled = WidestRows()
    train_step(build_llama(0), untiled)
    model = build_llama(0)
    TiledCompute(model, TilingSettings(True, True, tile), [])
    tiled = WidestRows()
    train_step(model, tiled)
    # The weights' own transposes have HIDDEN rows of these widths; one tile has ROWS * tile.
    bound = max(ROWS * tile, HIDDEN)
    for width in (VOCAB, INTERMEDIATE):
        assert untiled.rows[width] == ROWS * LENGTH > bound  # the check can fail
        assert tiled.rows[width] <= bound, (width, tiled.rows[width])


def test_a_forward_without_autograd_is_whole_and_remove_puts_the_forwards_back() -> None:
    model = build_llama(0)
    reference = copy.deepcopy(model)
    tiling = TiledCompute(model, TilingSettings(True, True, 3), [])
    with torch.no_grad():
        out, expected = model(**inputs()), reference(**inputs())
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-5)
    assert "forward" in model.model.layers[0].mlp.__dict__
    tiling.remove()
    swapped = [m for m in model.modules() if "forward" in m.__dict__]
    assert swapped == []


def test_what_cannot_be_tiled_exactly_is_refused() -> None:
    with pytest.raises(UsageError, match="not a Hugging Face model"):
        TiledCompute(torch.nn.Linear(2, 2), TilingSettings(True, False, 0), [])
    capped = build_llama(0)
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(UsageError, match="soft-caps its logits"):
        TiledCompute(capped, TilingSettings(False, True, 0), [])
    scaled = build_llama(0)
    TiledCompute(scaled, TilingSettings(False, True, 3), [])
    scaled.lm_head.register_forward_hook(lambda module, args, out: out * 2.0)
    with pytest.raises(UsageError, match="changed its logits after the output layer"):
        scaled(**inputs())
    with pytest.raises(ConfigError, match=r"compile\.enabled"):
        load_config(
            {
                "train_micro_batch_size_per_gpu": 1,
                "tiled_compute": {"mlp": True},
                "compile": {"enabled": True},
            },
            world_size=1,
        )
