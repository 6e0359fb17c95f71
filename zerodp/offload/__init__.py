"""ZeRO-Offload: where each group's optimizer copy, optimizer state and parameter shard live.

`policy` decides it once from the config (device, host memory, or files
under `nvme_path`); `storage` allocates the host-side tensors (pinned when an
accelerator is there) and the file-backed ones, and removes the files at the
end. The record of each group says where its tensors are
(`zerodp.group_state.OptimizerParam`, `FlatGroup.shard`); no map is kept here.
"""

from zerodp.offload.policy import OffloadPolicy, Placement
from zerodp.offload.storage import OffloadStorage

__all__ = ["OffloadPolicy", "OffloadStorage", "Placement"]
