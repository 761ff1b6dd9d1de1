"""Sizes in bytes as people write them: "512MiB", "12GiB", "1.5e9" to a count and back.

`MemoryModel`, `validate(max_bytes=)`, `schedcc.tune` and the CLI's `--memory` flags read sizes
with `parse_size` and print them with `format_size`.
"""

from __future__ import annotations

import math
import re

from schedcc.errors import ScheduleConfigError

__all__ = ["format_size", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str | float) -> int:
    """A byte count from `text`: a number with an optional unit (B, KB, MB, GB, TB in powers of
    1000; KiB, MiB, GiB, TiB in powers of 1024), e.g. "512MiB", "12GiB", "1.5e9".

    Raises:
        ScheduleConfigError: not a non-negative finite size with a known unit.

    >>> parse_size("512MiB"), parse_size("12GiB"), parse_size(100)
    (536870912, 12884901888, 100)
    """
    if isinstance(text, bool):
        raise ScheduleConfigError(f"expected a size such as 512MiB or 12GiB, got {text!r}")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _SIZE.fullmatch(str(text))
        if match is None or match.group(2).lower() not in _UNITS:
            raise ScheduleConfigError(
                f"expected a size such as 512MiB, 12GiB or 1.5e9 (bytes), got {text!r}"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    if not 0 <= value < math.inf:
        raise ScheduleConfigError(f"a size must be a finite number >= 0, got {text!r}")
    return round(value * _UNITS[unit])


def format_size(num_bytes: float) -> str:
    """`num_bytes` in the largest binary unit that keeps it >= 1 (e.g. "1.50 MiB").

    >>> format_size(1536 * 1024), format_size(12)
    ('1.50 MiB', '12 B')
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:g} B"
