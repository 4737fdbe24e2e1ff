"""What every benchmark prints first: the machine and versions, then the table's head."""

from __future__ import annotations

import platform

import torch


def print_header(settings: str, columns: list[str]) -> None:
    """The machine line (with ``settings``), a blank line, a markdown table's head."""
    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} threads; "
        f"torch {torch.__version__}; {settings}"
    )
    print()
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
