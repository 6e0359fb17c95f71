"""docs/configuration.md's DeepSpeed table agrees with the code, row by row and in its counts.

The table is what a DeepSpeed user reads before migrating; a row that says
"honoured" for a key the code drops would be worse than no table. Every
compatibility table entry must have a row, every row's class must be what
the code does with the key, and the counts at the end must add up.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from pydantic import BaseModel

from zerodp.config import ZeroDPConfig
from zerodp.config.deepspeed_keys import ALIAS_PATHS, IGNORED, UNSUPPORTED
from zerodp.config.errors import _model_in
from zerodp.config.optimizer import OPTIMIZER_PARAMS
from zerodp.config.scheduler import SCHEDULER_PARAMS

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
_ROW = re.compile(r"^\| `([^`]+)`[^|]*\| (honoured|no effect|not implemented|alias) \|")

# Typed sections that validate their keys but that nothing reads (none today).
SCHEMA_WITHOUT_EFFECT: set[str] = set()


def doc_rows() -> dict[str, str]:
    text = DOC.read_text().split("## DeepSpeed keys", 1)[1]
    rows: dict[str, str] = {}
    for line in text.splitlines():
        match = _ROW.match(line)
        if match:
            assert match.group(1) not in rows, f"two rows for {match.group(1)}"
            rows[match.group(1)] = match.group(2)
    return rows


def is_model_field(path: str) -> bool:
    model: type[BaseModel] | None = ZeroDPConfig
    parts = path.split(".")
    for index, part in enumerate(parts):
        if model is None or part not in model.model_fields:
            return False
        if part == "params" and index == 1 and index + 1 < len(parts):
            tables = OPTIMIZER_PARAMS if parts[0] == "optimizer" else SCHEDULER_PARAMS
            return any(parts[2] in m.model_fields for m in tables.values())
        model = _model_in(model.model_fields[part].annotation)
    return True


def code_class(path: str) -> str:
    if path in {e.path for e in IGNORED} or path in SCHEMA_WITHOUT_EFFECT:
        return "no effect"
    if path in {e.path for e in UNSUPPORTED}:
        return "not implemented"
    if path in ALIAS_PATHS:
        return "alias"
    if is_model_field(path):
        return "honoured"
    return f"unknown to the code: {path}"


def test_every_row_says_what_the_code_does() -> None:
    wrong = {p: (c, code_class(p)) for p, c in doc_rows().items() if c != code_class(p)}
    assert wrong == {}


def test_every_table_entry_has_a_row() -> None:
    rows = doc_rows()
    listed = [e.path for e in IGNORED] + [e.path for e in UNSUPPORTED] + list(ALIAS_PATHS)
    # The bf16 block's fp16 keys share one row.
    missing = [p for p in listed if p not in rows and not p.startswith("bf16.")]
    assert missing == []


def test_counts_add_up() -> None:
    counts = Counter(doc_rows().values())
    text = DOC.read_text().split("### Counts", 1)[1]
    stated = dict(
        re.findall(r"^\| (honoured|no effect|not implemented|alias) \| (\d+) \|", text, re.M)
    )
    assert {k: int(v) for k, v in stated.items()} == dict(counts)
