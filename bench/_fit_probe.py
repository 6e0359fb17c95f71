"""What the capped fit attempts of bench/scaling.py and bench/sequence_fit.py both read.

A fit attempt runs under RLIMIT_DATA in a fresh process and reports, never raises:
`vm_kib` reads the process's memory figures, `record_misfit` turns the failure that
ended an attempt into the row the driver prints.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any


def vm_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmData, VmHWM, ...); -1 where it is missing."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def record_misfit(result: dict[str, Any], exc: BaseException) -> None:
    """Any failure under the cap means the attempt does not fit: say which, and where."""
    result["ok"] = False
    first_line = (str(exc).splitlines() or [""])[0]
    result["error"] = f"{type(exc).__name__}: {first_line[:200]}"
    result["where"] = traceback.format_exc(limit=3).splitlines()[-3:]
