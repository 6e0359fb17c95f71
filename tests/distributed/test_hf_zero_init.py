"""`zero.Init` on real Hugging Face model code, at world size 2: built identical to a plain
build, then the first forward and three steps equal to the data-parallel reference.

Model code does everything to parameters while it builds: `init.zeros_` on a view
(`weight[padding_idx]`), `.data` reads, `.data` assignment (BERT pads its decoder bias
that way), tying, `post_init`. The reference is the same model built plainly from the same
seed (`ReferenceDP`: a copy per rank, each backward's gradients averaged with an explicit
all_reduce). Models run in eval mode so that dropout draws no random numbers.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.hf_architectures import BUILDERS, batch
from zerodp.testing import ReferenceDP

CONFIG = zerodp_config(
    3, micro_batch=2, optimizer=optimizer_config("AdamW", lr=1e-2), persistence_threshold=0
)


def _max_difference(model: nn.Module, reference: nn.Module) -> float:
    worst = 0.0
    for (name, param), (ref_name, ref_param) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert name == ref_name, (name, ref_name)
        value = zerodp.utils.safe_get_full_fp32_param(param)
        worst = max(worst, (value - ref_param.detach().float()).abs().max().item())
    return worst


def build_forward_train(name: str) -> dict[str, float]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    plain = BUILDERS[name]().eval()
    # The config's AdamW has no weight decay unless it says so (torch's default is 0.01).
    reference = ReferenceDP(
        plain, lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    )
    torch.manual_seed(0)
    with zerodp.zero.Init(config=CONFIG):
        model = BUILDERS[name]()
    report = {"init": _max_difference(model, plain)}
    engine, _, _, _ = zerodp.initialize(model=model, config=CONFIG)
    engine.eval()
    for step in range(3):
        inputs = batch(name, rank, step)
        loss = engine(**inputs).loss
        ref_loss = plain(**inputs).loss
        if step == 0:
            report["forward"] = abs(loss.item() - ref_loss.item())
        engine.backward(loss)
        reference.run_backward(ref_loss.backward)
        engine.step()
        reference.step()
        reference.zero_grad()
    report["steps"] = _max_difference(model, plain)
    engine.destroy()
    return report


@pytest.mark.parametrize("name", list(BUILDERS))
def test_hf_models_build_under_zero_init_and_train_exactly(pools, name: str) -> None:
    reports = pools(2).run(build_forward_train, name, timeout_s=240)
    for report in reports:
        assert report["init"] == 0.0, report  # the same random numbers, in the same order
        assert report["forward"] <= 1e-5, report
        assert report["steps"] <= 1e-4, report
    print(f"{name}: {reports[0]}")


# -- what a sharded model does with plain-module calls -------------------------------------


def module_calls_on_a_sharded_model() -> list[str]:
    torch.manual_seed(0)
    with zerodp.zero.Init(config=CONFIG):
        model = BUILDERS["llama"]()
    engine, _, _, _ = zerodp.initialize(model=model, config=CONFIG)
    assert model.to("cpu") is model  # the same device: nothing to move, nothing gathered
    messages = []
    weights = BUILDERS["llama"]().state_dict()
    for call in (model.state_dict, lambda: model.load_state_dict(weights)):
        # (torch's load_state_dict re-raises what a copy raised as a RuntimeError, message kept)
        with pytest.raises(RuntimeError) as error:
            call()
        messages.append(str(error.value))
    engine.destroy()
    return messages


def test_state_dict_on_a_sharded_model_names_the_zerodp_functions(pools) -> None:
    for message in pools(2).run(module_calls_on_a_sharded_model)[0]:
        assert "zerodp.zero.full_state_dict" in message, message
        assert "zerodp.zero.load_state_dict" in message, message


def views_outlive_their_gather() -> float:
    """A parent writing into a child's weight through a view, as model code does."""

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            row = self.emb.weight[0]  # gathered for the indexing, released after it
            with torch.no_grad():
                row.zero_()  # written later: through the view, gathered again
                self.emb.weight.data[1].fill_(3.0)
            self.proj = nn.Linear(4, 6)
            self.proj.bias.data = nn.functional.pad(self.proj.bias.data[:4], (0, 2))  # same shape
            self.scale = nn.Parameter(torch.ones(3))
            self.scale.data = torch.arange(5.0)  # a new shape: its group is sharded afresh

    torch.manual_seed(0)
    plain = Parent()
    torch.manual_seed(0)
    with zerodp.zero.Init(config=CONFIG):
        model = Parent()
    worst = 0.0
    with zerodp.zero.GatheredParameters(list(model.parameters())):
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            worst = max(worst, (p - q).abs().max().item())
        assert model.emb.weight[0].abs().sum().item() == 0.0
        assert model.emb.weight[1].eq(3.0).all()
        assert tuple(model.scale.shape) == (5,)
    assert zerodp.zero.param_status(model.scale) is zerodp.zero.ParamStatus.NOT_AVAILABLE
    return worst


def test_views_and_data_assignment_under_zero_init(pools) -> None:
    worst = pools(2).run(views_outlive_their_gather)
    assert worst == [0.0, 0.0]


# -- loading weights into a sharded model, one tensor at a time ----------------------------


def _wide_model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(16)])  # 64 MiB


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RSSHighWater:
    """The highest resident set size seen while the block runs (sampled every millisecond)."""

    def __enter__(self) -> _RSSHighWater:
        import threading

        self.start = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def load_into_sharded(path: str) -> dict[str, int]:
    config = zerodp_config(3, micro_batch=1, persistence_threshold=0)
    with zerodp.zero.Init(config=config):
        model = _wide_model()
    with _RSSHighWater() as rss:
        zerodp.zero.load_state_dict(model, path)
    from safetensors.torch import load_file

    expected = load_file(path)  # now, for the comparison only
    with zerodp.zero.GatheredParameters(list(model.parameters())):
        for key, value in model.state_dict().items():
            assert torch.equal(value, expected[key]), key
    return {"growth": rss.peak - rss.start}


def _exact_rss(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers started now allocate large buffers with mmap, so a freed buffer leaves the RSS
    (glibc otherwise raises its mmap threshold and keeps freed buffers in the heap)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))


def test_loading_weights_into_a_sharded_model_holds_one_tensor_at_a_time(
    tmp_path, monkeypatch
) -> None:
    _exact_rss(monkeypatch)
    from safetensors.torch import save_file

    from zerodp.testing import run_distributed

    torch.manual_seed(3)
    weights = _wide_model().state_dict()
    full = sum(t.numel() * t.element_size() for t in weights.values())
    largest = max(t.numel() * t.element_size() for t in weights.values())
    path = tmp_path / "model.safetensors"
    save_file(weights, str(path))
    del weights
    reports = run_distributed(load_into_sharded, 2, str(path), timeout_s=120)
    for report in reports:
        # Each rank's shards exist before the load; the load itself adds about one tensor
        # (read, then its shard kept). Holding the whole dict would add `full`.
        assert report["growth"] < full // 4, (report, full, largest)
    print(
        f"load: peak RSS growth per rank {[r['growth'] for r in reports]} bytes; "
        f"model {full} bytes, largest tensor {largest} bytes"
    )


# -- saving, streamed ----------------------------------------------------------------------


def save_streamed_and_reload(directory: str) -> float:
    rank = dist.get_rank()
    torch.manual_seed(0)
    with zerodp.zero.Init(config=CONFIG):
        model = BUILDERS["gpt2"]()
    engine, _, _, _ = zerodp.initialize(model=model, config=CONFIG)
    engine.eval()
    engine.backward(engine(**batch("gpt2", rank, 0)).loss)
    engine.step()
    files = zerodp.zero.save_state_dict(model, directory, max_shard_bytes=40_000)
    assert len(files) > 1  # several shards and an index, as save_pretrained writes
    probe = batch("gpt2", 0, 9)["input_ids"]
    with torch.no_grad():
        logits = engine(input_ids=probe).logits
    difference = 0.0
    if rank == 0:
        model.config.save_pretrained(directory)
        import transformers

        loaded = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()
        with torch.no_grad():
            difference = (loaded(input_ids=probe).logits - logits).abs().max().item()
    engine.destroy()
    return difference


def test_streamed_save_loads_with_from_pretrained(pools, tmp_path) -> None:
    differences = pools(2).run(save_streamed_and_reload, str(tmp_path / "hf"))
    assert differences[0] == 0.0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once


def save_wide(path: str) -> int:
    config = zerodp_config(3, micro_batch=1, persistence_threshold=0)
    torch.manual_seed(3)
    with zerodp.zero.Init(config=config):
        model = _wide_model()
    with _RSSHighWater() as rss:
        zerodp.zero.save_state_dict(model, path)
    return rss.peak - rss.start


def test_streamed_save_holds_one_group_at_a_time(tmp_path, monkeypatch) -> None:
    from safetensors.torch import load_file

    _exact_rss(monkeypatch)

    from zerodp.testing import run_distributed

    growth = run_distributed(save_wide, 2, str(tmp_path / "wide.safetensors"), timeout_s=120)
    torch.manual_seed(3)
    expected = _wide_model().state_dict()
    saved = load_file(str(tmp_path / "wide.safetensors"))
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in expected)
    full = sum(t.numel() * t.element_size() for t in expected.values())
    assert max(growth) < full // 4, (growth, full)
    print(f"save: peak RSS growth per rank {growth} bytes; model {full} bytes")


def load_hf_directory_into_init_model(directory: str) -> float:
    torch.manual_seed(0)
    source = BUILDERS["llama"]()
    zerodp.zero.save_state_dict(source, directory, max_shard_bytes=30_000)  # shards + index
    torch.manual_seed(1)  # other initial values: everything must come from the files
    with zerodp.zero.Init(config=CONFIG):
        model = BUILDERS["llama"]()
    zerodp.zero.load_state_dict(model, directory)
    worst = 0.0
    with zerodp.zero.GatheredParameters(list(model.parameters())):
        for key, value in source.state_dict().items():
            worst = max(worst, (model.state_dict()[key] - value).abs().max().item())
    return worst


def test_an_hf_directory_loads_into_a_model_built_sharded(pools, tmp_path) -> None:
    assert pools(2).run(load_hf_directory_into_init_model, str(tmp_path / "llama")) == [0.0, 0.0]
    assert (tmp_path / "llama" / "model.safetensors.index.json").is_file()
