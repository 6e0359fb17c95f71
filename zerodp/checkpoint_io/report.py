"""What a checkpoint load restored and what it did not, said once, on rank 0.

`engine.load_checkpoint` keeps DeepSpeed's return value `(path,
client_state)`; the report is kept as `engine.last_load_report`, logged at
INFO (what was restored) and, for anything left as it was, as one warning.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

logger = logging.getLogger("zerodp")


@dataclass
class LoadReport:
    """`source` names what was loaded; `restored` and `not_restored` are plain sentences."""

    source: str
    restored: list[str] = field(default_factory=list)
    not_restored: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"loaded {self.source}", "restored:"]
        lines += [f"  - {item}" for item in self.restored]
        if self.not_restored:
            lines.append("not restored:")
            lines += [f"  - {item}" for item in self.not_restored]
        return "\n".join(lines)

    def announce(self, rank: int) -> None:
        """Log the report on rank 0; what was not restored is also a warning there."""
        if rank != 0:
            return
        logger.info("%s", self)
        if self.not_restored:
            items = "; ".join(self.not_restored)
            warnings.warn(f"loading {self.source} left these as they were: {items}", stacklevel=3)
