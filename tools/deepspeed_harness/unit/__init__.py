"""DeepSpeed's `tests/unit` helpers that its test files import, for zerodp (see the package)."""
