"""`ZeroDPTrainer` under sequence parallelism: `"sequence_parallel_size"` in the zerodp config.

[Note: the Trainer and sequence parallelism]
The engine splits each forward itself (docs/sequence-parallel.md); what the
Trainer adds around it must count a sequence group as one data rank:

- Data: Accelerate shards each loader over every process; here over the data
  ranks (`ParallelDims.data_index` of `data_size`), so the ranks of a sequence
  group get the same batches (`_shard_loaders_by_data_rank`, `trainer_data`).
- Batch sizes: the config's "auto" batch counts data ranks (world size / S).
- Token counts: the Trainer and TRL divide counts gathered over every process
  by the ranks that share one batch, which they read from `get_tp_size()`;
  sequence ranks share their batch as tensor ranks do, so it counts them too
  (`get_tp_size`, TRL's `_tp_size`). The Trainer also divides the count of an
  ungathered batch by it (`average_tokens_across_devices=False`), which is
  undone for the sequence ranks (`_get_num_items_in_batch`); the tokens-seen
  counter counts each batch once (`_track_num_input_tokens`).
- Loss: a trainer's loss is built inside `compute_loss` from the model's
  outputs, which hold each rank's slice (its `.loss` part, per-token log-probs,
  ...). `compute_loss` runs the trainer's own with the engine returning parts
  (`SequenceParallel.loss_parts`) and returns their sum over the sequence
  group as the value, with this rank's part as the gradient (`_around_compute_loss`,
  outermost in the class order, so TRL's own `compute_loss` runs inside it).
- Accelerate's own sequence or context parallelism (`ParallelismConfig` with
  `sp_size` / `cp_size` > 1, from the TrainingArguments or Accelerate's
  config) would split the batch a second time: refused, naming zerodp's key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer

import zerodp
from zerodp.config.fields import parallel_size
from zerodp.errors import ConfigError
from zerodp.integrations.trainer_data import route_data_loaders
from zerodp.parallel import ParallelDims

SEQUENCE_KEY = "sequence_parallel_size"


def sequence_size_of(config: dict[str, Any]) -> int:
    """S of a zerodp config dict (1 without the key); `ConfigError` for a value that is not
    a positive integer, before any loader is split by it."""
    return parallel_size(config.get(SEQUENCE_KEY), SEQUENCE_KEY)


def refuse_accelerate_parallelism(parallelism: Any, where: str) -> None:
    """Accelerate's sequence or context parallelism, which zerodp does itself."""
    if parallelism is None:
        return
    problems = [
        f"{name}={size}"
        for name in ("sp_size", "cp_size")
        if isinstance(size := getattr(parallelism, name, 1) or 1, int) and size > 1
    ]
    if problems:
        raise ConfigError(
            f"{where} sets Accelerate's ParallelismConfig({', '.join(problems)}); zerodp splits "
            f'sequences itself: remove it and set "{SEQUENCE_KEY}" in zerodp_config instead '
            "(docs/sequence-parallel.md)"
        )


class TrainerSequence(Trainer):
    """The Trainer's data, counts and loss under sequence parallelism (see the Note above)."""

    # Provided by ZeroDPTrainer.
    engine: zerodp.ZeroEngine | None
    _sequence_size: int
    _in_sequence_loss: bool
    _data_ranks: ParallelDims

    def _shard_loaders_by_data_rank(self) -> None:
        """Accelerate's loaders sharded over the data ranks (after the Accelerator is made)."""
        refuse_accelerate_parallelism(
            getattr(self.accelerator, "parallelism_config", None), "Accelerate's config"
        )
        route_data_loaders(self.accelerator, self._data_ranks)

    def _ranks_per_batch(self) -> int:
        """The ranks sharing one batch (tensor x sequence ranks); S before the Accelerator
        (and with it the data ranks) is made."""
        ranks = self.__dict__.get("_data_ranks")
        return self._sequence_size if ranks is None else ranks.ranks_per_batch

    # -- counts ----------------------------------------------------------------------------

    def get_tp_size(self) -> int:
        """The ranks that share one batch, as the Trainer uses it: tensor x sequence ranks."""
        return int(super().get_tp_size()) * self._ranks_per_batch()

    @property
    def _tp_size(self) -> int:
        """TRL's count of the ranks sharing one batch (it divides gathered token counts by
        it): its own value, times the tensor and sequence ranks."""
        return int(self.__dict__.get("_trl_tp_size", 1)) * self._ranks_per_batch()

    @_tp_size.setter
    def _tp_size(self, value: int) -> None:
        self.__dict__["_trl_tp_size"] = value

    def _get_num_items_in_batch(self, batch_samples: list[Any], device: torch.device) -> Any:
        count = super()._get_num_items_in_batch(batch_samples, device)
        if (
            self._ranks_per_batch() > 1
            and torch.is_tensor(count)
            and not self.args.average_tokens_across_devices
        ):
            # Not gathered, this is the batch's own count, which the Trainer still divided by
            # the ranks sharing it; that division is undone.
            count = count * self._ranks_per_batch()
        return count

    def _track_num_input_tokens(self, inputs: Any) -> None:
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        seen = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + seen // self._ranks_per_batch()

    # -- the loss ----------------------------------------------------------------------

    def compute_loss(
        self,
        model: Any,
        inputs: Any,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        return self._around_compute_loss(
            super().compute_loss, model, inputs, return_outputs, num_items_in_batch
        )

    def _around_compute_loss(
        self,
        inner: Callable[..., Any],
        model: Any,
        inputs: Any,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        engine = self.engine
        sequence = engine.sequence_parallel if engine is not None else None
        if sequence is None or self._in_sequence_loss:
            return inner(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        self._in_sequence_loss = True
        try:
            with sequence.loss_parts():
                result = inner(
                    model,
                    inputs,
                    return_outputs=return_outputs,
                    num_items_in_batch=num_items_in_batch,
                )
        finally:
            self._in_sequence_loss = False
        if return_outputs:
            loss, outputs = result
            return sequence.sum(loss), outputs
        return sequence.sum(result)
