"""The pool's workers fail a task in which zerodp's code calls an API torch deprecates.

torch 2.13 deprecates `all_gather_into_tensor` with a `FutureWarning` that it attributes
to its own logging wrapper (`torch.distributed.c10d_logger`), not to the caller, so no
filter on zerodp's modules sees it. zerodp calls `all_gather_single`
(`zerodp.comm.single_tensor`); here the old name is put back, for one task, where
`Comm.all_gather` and `Comm.all_gather_object` call it, and the task must fail on every
rank naming those lines. Every other distributed test runs under the same check, so a
step at every stage, the long-sequence example and the rest print no deprecation zerodp
caused. One fresh pair of processes (the failure closes the pool it ran in).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerodp.comm import Comm, collectives, object_collectives
from zerodp.testing import DistributedTestError, run_distributed


def gather_with_the_deprecated_name() -> list[object]:
    current = collectives.all_gather_single
    collectives.all_gather_single = dist.all_gather_into_tensor
    object_collectives.all_gather_single = dist.all_gather_into_tensor
    try:
        comm = Comm()
        gathered = torch.empty(comm.world_size)
        comm.all_gather(gathered, torch.tensor([float(comm.rank)]))
        return [gathered.tolist(), comm.all_gather_object(comm.rank)]
    finally:
        collectives.all_gather_single = current
        object_collectives.all_gather_single = current


@pytest.mark.skipif(
    not hasattr(dist, "all_gather_single"), reason="this torch has only the old name"
)
def test_a_task_that_makes_zerodp_call_a_deprecated_api_fails() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(gather_with_the_deprecated_name, 2)
    message = str(info.value)
    for rank in (0, 1):
        assert f"rank {rank}:" in message
    # Comm.all_gather's line, and the lengths' and the bytes' gathers of all_gather_object.
    assert message.count("DeprecationCausedError: zerodp caused 3 deprecation warning(s)") == 2
    assert message.count("FutureWarning caused by zerodp/comm/collectives.py:") == 2
    assert message.count("FutureWarning caused by zerodp/comm/object_collectives.py:") == 4
    assert "`torch.distributed.all_gather_into_tensor` is deprecated" in message
