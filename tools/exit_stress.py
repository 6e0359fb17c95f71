"""How failing runs end, under load: each scenario of `exit_scenarios.py` run many times.

    python tools/exit_stress.py                 # 20 runs of each scenario, 2 busy loops
    python tools/exit_stress.py --runs 3 --busy 0 --scenarios mismatch,user_error

Two busy loops keep the machine's cores loaded (that is when a process ended by SIGABRT
at exit used to show up: see [Note: ending the process] in zerodp/comm/faults/teardown.py).
The table counts each rank's exit status per scenario; a status other than the expected one
is printed with that rank's output, and the script exits 1 if there was any.
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

from tools.exit_scenarios import EXPECTED
from zerodp.testing.ranks import run_ranks

SCRIPT = Path(__file__).with_name("exit_scenarios.py")


def _busy_loops(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the runs")
    parser.add_argument("--scenarios", default=",".join(EXPECTED))
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    unknown = sorted(set(scenarios) - set(EXPECTED))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {sorted(EXPECTED)}")
    loops = _busy_loops(args.busy)
    failures = 0
    rows = []
    try:
        with tempfile.NamedTemporaryFile() as not_a_directory, tempfile.TemporaryDirectory() as d:
            for scenario in scenarios:
                counts: Counter[tuple[int, int | None]] = Counter()
                start = time.monotonic()
                for run in range(args.runs):
                    exits = run_ranks(
                        [str(SCRIPT), scenario, not_a_directory.name, d], timeout_s=180
                    )
                    for expected, rank_exit in zip(EXPECTED[scenario], exits, strict=True):
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
    print(f"\n{args.runs} runs per scenario, {args.busy} busy loops, 2 ranks each")
    header = ("scenario", "expected", "rank 0 statuses", "rank 1 statuses")
    print(f"{header[0]:<12} {header[1]:<10} {header[2]:<22} {header[3]:<22} s/run")
    for scenario, counts, seconds in rows:
        print(_row(scenario, counts, seconds))
    print("all as expected" if failures == 0 else f"{failures} rank exits not as expected")
    return 0 if failures == 0 else 1


def _row(scenario: str, counts: Counter[tuple[int, int | None]], seconds: float) -> str:
    cells = []
    for rank in (0, 1):
        seen = {status: n for (r, status), n in counts.items() if r == rank}
        cells.append(", ".join(f"{status}: {n}x" for status, n in sorted(seen.items(), key=str)))
    expected = "/".join(str(s) for s in EXPECTED[scenario])
    return f"{scenario:<12} {expected:<10} {cells[0]:<22} {cells[1]:<22} {seconds:.1f}"


if __name__ == "__main__":
    sys.exit(main())
