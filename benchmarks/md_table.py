"""The markdown table the probe and sweep scripts of this folder print last."""
from __future__ import annotations


def print_table(header: list[str], align: str, rows: list[tuple]) -> None:
    """One markdown table: ``header`` cells, ``align`` one letter per column (``l`` left,
    ``r`` right), then each row's cells as ``str`` gives them."""
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---:" if a == "r" else "---" for a in align) + " |")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
