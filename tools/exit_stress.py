"""How failing runs end, under load: each scenario of `exit_scenarios.py` run many times.

    python tools/exit_stress.py                 # 20 runs of each scenario, 2 busy loops
    python tools/exit_stress.py --runs 3 --busy 0 --scenarios mismatch,user_error
    python tools/exit_stress.py --scenarios uneven          # every uneven-input pairing
    python tools/exit_stress.py --scenarios uneven/stage3   # those of one config
    python tools/exit_stress.py --scenarios uneven --preload   # ranks forked after the import

Two busy loops keep the machine's cores loaded (that is when a process ended by SIGABRT
at exit used to show up: see [Note: ending the process] in zerodp/comm/faults/teardown.py).
The table counts each rank's exit status per scenario; a status other than the expected one
is printed with that rank's output, and the script exits 1 if there was any.

Most of a run's CPU is importing torch and zerodp. With `--preload` each rank is forked
from a server that has done that import once (`tools/preloaded_ranks.py`), and runs the
scenario and the interpreter's shutdown as a script does: about 3 times as many runs in an
hour, under the same busy loops.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.exit_scenarios import EXPECTED, UNEVEN
from tools.preloaded_ranks import PreloadedRanks
from zerodp.testing.ranks import run_ranks

SCRIPT = Path(__file__).with_name("exit_scenarios.py")


def _busy_loops(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the runs")
    parser.add_argument(
        "--preload", action="store_true", help="fork each rank after importing torch and zerodp"
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(EXPECTED),
        help="names from exit_scenarios.py; 'uneven' (every pairing) or 'uneven/<config>'",
    )
    args = parser.parse_args()
    scenarios = _expand(args.scenarios.split(","))
    unknown = sorted(set(scenarios) - set(_ALL))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {sorted(EXPECTED)} or uneven")
    preloaded = PreloadedRanks("tools.exit_scenarios") if args.preload else None
    launch = preloaded.run if preloaded is not None else run_ranks
    loops = _busy_loops(args.busy)
    failures = 0
    rows = []
    try:
        with tempfile.NamedTemporaryFile() as not_a_directory, tempfile.TemporaryDirectory() as d:
            for scenario in scenarios:
                counts: Counter[tuple[int, int | None]] = Counter()
                start = time.monotonic()
                for run in range(args.runs):
                    exits = launch(
                        [str(SCRIPT), scenario, not_a_directory.name, d],
                        world_size=len(_ALL[scenario]),
                        timeout_s=180,
                    )
                    for expected, rank_exit in zip(_ALL[scenario], exits, strict=True):
                        counts[(rank_exit.rank, rank_exit.status)] += 1
                        if rank_exit.status != expected:
                            failures += 1
                            print(
                                f"--- {scenario} run {run + 1} rank {rank_exit.rank}: "
                                f"status {rank_exit.status}, expected {expected}\n"
                                f"{rank_exit.output[-3000:]}",
                                flush=True,
                            )
                seconds = (time.monotonic() - start) / args.runs
                rows.append((scenario, counts, seconds))
                print(_row(scenario, counts, seconds), flush=True)
    finally:
        for loop in loops:
            loop.kill()
        if preloaded is not None:
            preloaded.close()
    how = "forked after the import" if args.preload else "each a fresh interpreter"
    print(f"\n{args.runs} runs per scenario, {args.busy} busy loops, ranks {how}")
    print(f"{'scenario':<{_WIDTH}} {'expected':<10} statuses of rank 0, 1, ...  s/run")
    for scenario, counts, seconds in rows:
        print(_row(scenario, counts, seconds))
    print("all as expected" if failures == 0 else f"{failures} rank exits not as expected")
    return 0 if failures == 0 else 1


_ALL = {**EXPECTED, **UNEVEN}
_WIDTH = max(len(name) for name in _ALL)


def _expand(names: list[str]) -> list[str]:
    """'uneven' is every uneven-input pairing, 'uneven/<config>' those of one config."""
    out: list[str] = []
    for name in names:
        if name == "uneven" or (name.startswith("uneven/") and name.count("/") == 1):
            out += [s for s in UNEVEN if s == name or s.startswith(name + "/")]
        else:
            out.append(name)
    return out


def _row(scenario: str, counts: Counter[tuple[int, int | None]], seconds: float) -> str:
    cells = []
    for rank in range(len(_ALL[scenario])):
        seen = {status: n for (r, status), n in counts.items() if r == rank}
        cells.append(", ".join(f"{status}: {n}x" for status, n in sorted(seen.items(), key=str)))
    expected = "/".join(str(s) for s in _ALL[scenario])
    return f"{scenario:<{_WIDTH}} {expected:<10} {' | '.join(cells)}  {seconds:.1f}"


if __name__ == "__main__":
    sys.exit(main())
