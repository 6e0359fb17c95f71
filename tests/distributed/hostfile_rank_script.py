"""Run on every rank by test_hostfile_launch: what the rank was given, written to a file.

    python hostfile_rank_script.py --local_rank=N --out DIR [--fail-rank R] [--hang]

Each rank joins the process group (gloo), checks the world with an all-reduce, and writes
its rank, world, node, `--local_rank` and the variable `.deepspeed_env` sets. With
`--fail-rank R` rank R exits with status 3 and the others wait in a long sleep (a stuck
rank), which the launcher must end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fail-rank", type=int, default=-1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.ones(1)
    dist.all_reduce(total)
    record = {
        "rank": rank,
        "world": dist.get_world_size(),
        "summed": int(total.item()),
        "node": int(os.environ["GROUP_RANK"]),
        "local_rank_arg": args.local_rank,
        "from_env_file": os.environ.get("ZDP_FROM_ENV_FILE"),
        "forwarded": os.environ.get("PYTHONHASHSEED"),
        "pid": os.getpid(),
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(record))
    if args.fail_rank == rank:
        # Ends at once with 3: an exit through the interpreter's finalization with the
        # process group still up can end by gloo's SIGABRT instead (zerodp's teardown
        # prevents that for zerodp's scripts; this one uses torch.distributed only).
        sys.stdout.flush()
        os._exit(3)
    if args.fail_rank >= 0:
        time.sleep(600)  # stuck: only the launcher's stop ends it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
