"""The engines of bench/expert_parallel.py, each behind one small surface.

A runner trains its own copy of the bench's Qwen3-MoE (`build_model`, the same
weights for all) and answers, on this rank: one training step on a batch (the loss),
the step's bytes by purpose (`bench._expert_traffic`), the model-state bytes it holds
(expert, all), the most parameter bytes it had gathered at once during the step, and
the largest difference of its weights from the one-process reference.

- `ZeroDPRunner`: `zerodp.initialize` at ZeRO stage 3, with `"expert_parallel":
  {"enabled": true, "autoep_size": E}` when E > 1.
- `PlainRunner`: the floor of round-off: a plain copy of the model on every rank, its
  gradients averaged by an explicit all-reduce, clipped by torch, the same torch optimizer
  (ideal data parallelism, as the project's tests compute it); not sharded.
- `AutoEPRunner`: DeepSpeed's `deepspeed.initialize` at stage 3 with `"expert_parallel":
  {"enabled": true, "autoep_size": E, "preset_model": "qwen3_moe"}` and the same torch
  optimizer. Its parameters are AutoEP's own (`mlp.router.gate`, grouped experts w1, w2,
  w3 per EP rank); they are compared with the same parts of the reference
  (`deepspeed_reference_view`), and checked equal to the initial weights first, so the
  mapping itself is tested.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from bench._expert_parallel_model import (
    CLIP,
    MICRO,
    OptimizerSpec,
    build_model,
    deepspeed_reference_view,
    largest_difference,
    stage3_knobs,
)
from bench._expert_traffic import (
    ExpertGatherLedger,
    GroupCollectiveCounter,
    deepspeed_group_labels,
    deepspeed_state_bytes,
    zerodp_expert_state_bytes,
    zerodp_traffic,
)


class ZeroDPRunner:
    def __init__(
        self, model: dict[str, int], optimizer: OptimizerSpec, ep_size: int, label: str
    ) -> None:
        import zerodp

        self.label = label
        self.ep_size = ep_size
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": optimizer.zerodp_block(),
            "gradient_clipping": CLIP,
            "zero_optimization": {"stage": 3, **stage3_knobs(model)},
            "steps_per_print": 1_000_000,
        }
        if ep_size > 1:
            config["expert_parallel"] = {"enabled": True, "autoep_size": ep_size}
        self.engine, _, _, _ = zerodp.initialize(model=build_model(model), config=config)
        self.ledger = ExpertGatherLedger(self.engine)
        self.module = self.engine.module
        self.gatherer: Any = getattr(self.engine.params, "gatherer")  # noqa: B009 (stage 3)

    def step(self, ids: torch.Tensor) -> float:
        self.engine.comm.stats.reset()
        self.ledger.reset()
        self.gatherer.reset_peak()
        loss = self.engine(input_ids=ids, labels=ids).loss
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.item())

    def traffic(self) -> dict[str, int]:
        return zerodp_traffic(self.engine, self.ledger)

    def peak_gathered_bytes(self) -> int | None:
        return int(self.gatherer.peak_live_numel) * 4  # fp32

    def state_bytes(self) -> tuple[int, int]:
        experts, total = zerodp_expert_state_bytes(self.engine)
        reported = self.engine.model_state_bytes().total
        if total != reported:  # the split must add up to the engine's own accounting
            raise AssertionError(f"{self.label}: groups hold {total} B, engine says {reported}")
        return experts, total

    def weight_difference(self, reference: dict[str, torch.Tensor]) -> float:
        split = self.engine.expert_parallel

        def expected(name: str, shape: torch.Size) -> torch.Tensor:
            whole = reference[name]
            if split is not None and split.expert_of(name) is not None and shape != whole.shape:
                return split.local_part(name, whole)
            return whole

        state = self.engine.state_dict()
        return largest_difference(
            ((n, v) for n, v in state.items()),
            lambda n: expected(n, state[n].shape),
            reference,
        )

    def close(self) -> None:
        self.ledger.close()
        self.engine.destroy()


class PlainRunner:
    def __init__(
        self, model: dict[str, int], optimizer: OptimizerSpec, ep_size: int, label: str
    ) -> None:
        self.label = label
        self.model = build_model(model)
        self.optimizer = optimizer.build(self.model.parameters())
        self.module = self.model
        self.sent = 0

    def step(self, ids: torch.Tensor) -> float:
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        world = dist.get_world_size()
        self.sent = 0
        for param in self.model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad.div_(world)
                self.sent += param.grad.numel() * param.grad.element_size()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # the gradients stay held, as counted
        return float(loss.item())

    def traffic(self) -> dict[str, int]:
        out = dict.fromkeys(("expert_gathers", "other_gathers", "token_all_to_all", "other"), 0)
        return out | {"reductions": self.sent}

    def peak_gathered_bytes(self) -> int | None:
        return 0

    def state_bytes(self) -> tuple[int, int]:
        from bench._expert_parallel_model import is_expert_name
        from zerodp.monitor import plain_model_state_bytes

        total = plain_model_state_bytes(self.model, self.optimizer).total
        experts = 0
        for name, param in self.model.named_parameters():
            if is_expert_name(name):  # the parameter, its gradient, its optimizer state
                held = [param, param.grad, *self.optimizer.state.get(param, {}).values()]
                experts += sum(t.numel() * t.element_size() for t in held if torch.is_tensor(t))
        return experts, total

    def weight_difference(self, reference: dict[str, torch.Tensor]) -> float:
        return largest_difference(
            iter(self.model.named_parameters()), reference.__getitem__, reference
        )

    def close(self) -> None:
        del self.model, self.optimizer, self.module


class AutoEPRunner:
    def __init__(
        self, model: dict[str, int], optimizer: OptimizerSpec, ep_size: int, label: str
    ) -> None:
        import deepspeed
        from deepspeed.utils import groups

        self.label = label
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP,
            "zero_optimization": {"stage": 3, **stage3_knobs(model)},
            "expert_parallel": {
                "enabled": True,
                "autoep_size": ep_size,
                "preset_model": "qwen3_moe",
            },
            "zero_allow_untested_optimizer": True,  # torch's optimizer: no fused-op build
            "steps_per_print": 1_000_000,
        }
        self.engine, _, _, _ = deepspeed.initialize(
            model=build_model(model), config=config, optimizer=optimizer.build
        )
        self.module = self.engine.module
        self.ep_size = ep_size
        self.ep_rank = groups._get_expert_parallel_rank(f"ep_size_{ep_size}")
        self.counter = GroupCollectiveCounter(deepspeed_group_labels(ep_size))
        initial = {n: p.detach().clone() for n, p in build_model(model).named_parameters()}
        start = self._difference(initial)
        if start != 0.0:
            raise AssertionError(f"AutoEP's weights do not map onto the model's: {start}")

    def step(self, ids: torch.Tensor) -> float:
        with self.counter.active():
            loss = self.engine(input_ids=ids, labels=ids).loss
            self.engine.backward(loss)
            self.engine.step()
        return float(loss.item())

    def traffic(self) -> dict[str, int]:
        return self.counter.traffic()

    def peak_gathered_bytes(self) -> int | None:
        return None

    def state_bytes(self) -> tuple[int, int]:
        return deepspeed_state_bytes(self.engine)

    def _difference(self, reference: dict[str, torch.Tensor]) -> float:
        import deepspeed

        named = list(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return largest_difference(
                iter(named),
                lambda n: deepspeed_reference_view(reference, n, self.ep_rank, self.ep_size),
                [],
            )

    def weight_difference(self, reference: dict[str, torch.Tensor]) -> float:
        return self._difference(reference)

    def close(self) -> None:
        self.engine.destroy()


def autoep_start_failure(model: dict[str, int], optimizer: OptimizerSpec, ep_size: int) -> str:
    """Try AutoEP unpatched on this model: '' if it starts, otherwise the error it raised
    (on every rank alike; the engine is dropped)."""
    try:
        runner = AutoEPRunner(model, optimizer, ep_size, "probe")
    except Exception as exc:  # the error is the finding; it is reported, then patched
        dist.barrier()
        return f"{type(exc).__name__}: {exc}"
    runner.close()
    return ""
