"""Ranks forked after the import (tools/preloaded_ranks.py) end as fresh processes do.

`tools/exit_stress.py --preload` counts on it: a rank's status is the script's own exit
code, 1 after an uncaught exception, a negative signal number when the interpreter's
shutdown aborts, and None when the deadline killed it; the same script run as plain
processes (`run_ranks`) gives the same statuses.
"""

from __future__ import annotations

from pathlib import Path

from tools.preloaded_ranks import PreloadedRanks
from zerodp.testing.ranks import run_ranks

SCRIPT = """
import atexit, os, sys, time
import torch.distributed as dist

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
dist.barrier()
print(f"rank {rank} of {os.environ['WORLD_SIZE']}, argv {sys.argv[1:]}", flush=True)
if rank == 1:
    atexit.register(os.abort)  # dies by SIGABRT during the interpreter's shutdown
if rank == 2:
    raise ValueError("an uncaught error")
if rank == 3:
    time.sleep(300)
sys.exit(5 if rank == 0 else 0)
"""


def test_forked_ranks_end_as_fresh_processes_do(tmp_path: Path) -> None:
    script = tmp_path / "ending.py"
    script.write_text(SCRIPT)
    instant = tmp_path / "instant.py"
    instant.write_text("import os, sys\nsys.exit(int(os.environ['RANK']) + 2)\n")
    ranks = PreloadedRanks("zerodp")
    try:
        forked = ranks.run([str(script), "an-arg"], world_size=4, timeout_s=12)
        # Ranks that end at once: the server's two replies (the ranks' pids, then their
        # statuses) arrive together, and both must be read (a buffered reader once held
        # the second while `select` waited for it, until the run hung).
        for _ in range(4):
            statuses = [e.status for e in ranks.run([str(instant)], world_size=2, timeout_s=30)]
            assert statuses == [2, 3]
    finally:
        ranks.close()
    fresh = run_ranks([str(script), "an-arg"], world_size=3, timeout_s=60)

    assert [e.status for e in forked] == [5, -6, 1, None]
    assert [e.status for e in fresh] == [5, -6, 1]
    for exit_ in forked:
        assert f"rank {exit_.rank} of 4, argv ['an-arg']" in exit_.output
    assert "ValueError: an uncaught error" in forked[2].output
    assert "ValueError: an uncaught error" in fresh[2].output
