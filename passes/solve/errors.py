"""The solver's error: no plan, or the solver failed."""

from __future__ import annotations

__all__ = ["SolveError"]


class SolveError(RuntimeError):
    """The ILP has no solution or the solver failed. ``least_bytes``: where no plan fits
    the memory budget, the smallest budget per rank that one fits (else None).
    ``floor_bytes``: where the model's state alone is above the budget (``state_floor``),
    that floor, and no solve was run (else None)."""

    def __init__(
        self, message: str, least_bytes: int | None = None, floor_bytes: int | None = None
    ):
        super().__init__(message)
        self.least_bytes = least_bytes
        self.floor_bytes = floor_bytes
