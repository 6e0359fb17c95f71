"""Which dtype each piece of model state has: decided once, from the config.

| state                         | fp32   | bf16 / fp16                                  |
|-------------------------------|--------|----------------------------------------------|
| parameters, activations       | fp32   | bf16 / fp16                                  |
| optimizer copy (owned range)  | none   | fp32 (the master weights)                    |
| optimizer state               | fp32   | fp32                                         |
| kept gradients                | fp32   | the model's dtype; fp32 when accumulating    |
| gradient communication        | the gradients' dtype, or communication_data_type |
| ... with sequence parallelism | seq_parallel_communication_data_type (fp32 unless set) |

Gradients are kept in fp32 when `gradient_accumulation_steps` > 1, so that
summing micro-batches does not round in half precision; with one micro-batch
per step they are kept in the model's dtype, which gives the ZeRO paper's
2 + 2 + 12 bytes per parameter.

With `sequence_parallel_size` > 1, `seq_parallel_communication_data_type`
replaces `communication_data_type`, as in DeepSpeed (whose engine does the
same swap): its default is fp32, so bf16 gradients summed over a sequence
group are summed in fp32 unless the config says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerodp.config import ZeroDPConfig

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    param_dtype: torch.dtype
    grad_storage_dtype: torch.dtype
    comm_dtype: torch.dtype | None  # None: the gradients' own dtype

    @property
    def mixed(self) -> bool:
        return self.param_dtype != torch.float32


def precision_policy(config: ZeroDPConfig) -> PrecisionPolicy:
    if config.bf16.enabled:
        param_dtype = torch.bfloat16
    elif config.fp16.enabled:
        param_dtype = torch.float16
    else:
        param_dtype = torch.float32
    accumulating = config.batch_sizes.gradient_accumulation_steps > 1
    grad_dtype = torch.float32 if accumulating else param_dtype
    comm = config.communication_data_type
    if config.sequence_parallel_size > 1:
        comm = config.seq_parallel_communication_data_type
    return PrecisionPolicy(
        param_dtype=param_dtype,
        grad_storage_dtype=grad_dtype,
        comm_dtype=_DTYPES[comm] if comm is not None else None,
    )
