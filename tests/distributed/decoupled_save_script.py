"""Started as fresh ranks by test_decoupled_save: a decoupled save that never completes.

    python decoupled_save_script.py kill|exit DIRECTORY   (torchrun's variables set)

Both modes train the run of tests/decoupled_setup.py at stage 2 for two micro-steps,
save 'before' and wait for it, then save 'after' (decoupled) and train on:

- kill: each rank's writer kills its own process with SIGKILL once training has gone on,
  rank 1 right after it posted its report, rank 0 once every report is in (the files of
  both ranks are written and fsynced; only the commit is left);
- exit: the last rank cannot write its data file (ENOSPC); the script ends without waiting;
- finish: the writer takes a second before it writes; the script ends without waiting.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import decoupled_setup as run
from zerodp.checkpoint_io import background_save


def main() -> None:
    mode, folder = sys.argv[1], Path(sys.argv[2])
    _, engine, loader = run.build(2)
    run.micro_steps(engine, loader, 2)
    engine.save_checkpoint(folder, "before")
    engine.wait_for_checkpoint()
    rank = engine.global_rank
    trained_on = threading.Event()
    if mode == "kill":
        last_step = "reported" if rank == 1 else "all_reported"

        def die(step: str) -> None:
            if step == last_step:
                trained_on.wait(timeout=60)
                os.kill(os.getpid(), signal.SIGKILL)

        background_save.on_write_step = die
    elif mode == "finish":

        def slow(step: str) -> None:
            if step == "started":
                time.sleep(1.0)

        background_save.on_write_step = slow
    elif rank == engine.world_size - 1:
        from torch.distributed.checkpoint import filesystem

        def no_space(self, path, mode):  # type: ignore[no-untyped-def]
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        filesystem.FileSystem.create_stream = no_space  # type: ignore[method-assign]
    engine.save_checkpoint(folder, "after")
    run.micro_steps(engine, loader, 2)
    print("TRAINED ON", flush=True)
    trained_on.set()
    if mode == "kill":
        time.sleep(60)  # the writer ends this process
        raise SystemExit("the writer did not kill this process")


if __name__ == "__main__":
    main()
