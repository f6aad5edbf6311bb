"""Memory and counts as a person reads them: decimal units, 1 GB = 10^9 bytes; "4 ranks".

Every text autopar writes for a reader (``Plan.summary()``, ``autopar compare``'s
table, the command line, error messages) gives memory in GB, or in MB / kB / B when it
is smaller, all powers of 1000, never GiB. Values in the API stay bytes
(``Plan.memory_per_device_bytes``, ``memory_budget=``).
"""

from __future__ import annotations

GB = 1e9
"""Bytes in the gigabyte autopar writes (decimal, as GPU datasheets give memory)."""

DECIMAL_UNITS = (("GB", GB), ("MB", 1e6), ("kB", 1e3))


def fmt_bytes(n: float) -> str:
    """Bytes in the largest decimal unit up to GB that the size reaches:
    ``79.46e9`` -> "79.46 GB", ``8.4e6`` -> "8.40 MB", ``512`` -> "512 B"."""
    for unit, scale in DECIMAL_UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def count_text(n: int, word: str) -> str:
    """``n`` and ``word``, plural unless ``n`` is 1: '1 rank', '4 ranks'."""
    return f"{n} {word}" + ("" if n == 1 else "s")
