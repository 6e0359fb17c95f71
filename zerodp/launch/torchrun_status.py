"""torchrun in this process, its exit status the script's: the first failed rank's.

`zerodp run` runs torchrun so on one machine; on each host of a hostfile launch the node
agent runs this file as a program (`python .../torchrun_status.py ARGS`), which imports
torch and nothing of zerodp (a process started once per host and run).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence


def exit_status_of(error: BaseException) -> int:
    """The exit status to report for torchrun's ChildFailedError: the first failed rank's.

    A rank killed by a signal shows a negative exit code in torchrun; shells
    report that as 128 + signal number, and so does zerodp.
    """
    first_failure = getattr(error, "get_first_failure", None)
    if first_failure is None:
        return 1
    _, failure = first_failure()
    code = int(failure.exitcode)
    if code < 0:
        return 128 + (-code)
    return code if code > 0 else 1


def run_torchrun(torchrun_argv: Sequence[str]) -> int:
    """Run torchrun in this process with `torchrun_argv`; the script's exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(list(torchrun_argv))
    except ChildFailedError as error:
        # torchrun's summary: which ranks failed, how, and the first failure (its root cause).
        print(str(error).strip(), file=sys.stderr, flush=True)
        return exit_status_of(error)
    except SignalException as error:
        # torchrun stopped the workers because this process was signalled.
        return 128 + int(error.sigval)
    except KeyboardInterrupt:
        return 128 + int(signal.SIGINT)
    return 0


if __name__ == "__main__":
    del sys.path[0]  # run as a file: its folder must not shadow what torchrun imports
    sys.exit(run_torchrun(sys.argv[1:]))
