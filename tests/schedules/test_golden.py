"""Golden per-stage compute orders of the built-in schedules, compared exactly.

Each file under tests/schedules/golden/ holds `collect(schedule).to_text()` (the compute order the
schedule yields, before the compiler adds comm and updates). They were checked by hand against the
papers and Megatron-LM (see the schedule modules' docstrings). Regenerating is a manual, reviewed
step:

    .venv/bin/python tests/schedules/test_golden.py   # rewrites golden/*.txt; review the diff
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import schedcc
from schedcc.passes import collect

GOLDEN = Path(__file__).parent / "golden"

#: (schedule name, p, m, v, batches)
CASES = [
    ("gpipe", 4, 4, 1, 1),
    ("gpipe", 2, 2, 2, 2),
    ("1f1b", 4, 8, 1, 1),
    ("1f1b", 4, 2, 1, 2),
    ("interleaved-1f1b", 4, 8, 2, 1),
    ("interleaved-1f1b", 2, 4, 3, 1),
    ("interleaved-1f1b", 4, 4, 2, 1),
    ("interleaved-1f1b", 4, 6, 2, 1),
    ("interleaved-1f1b", 4, 3, 2, 1),
    ("interleaved-1f1b", 4, 10, 2, 1),
    ("interleaved-1f1b", 2, 4, 2, 2),
    ("2bw", 4, 4, 1, 2),
    ("2bw", 4, 8, 1, 3),
]


def _path(name: str, p: int, m: int, v: int, batches: int) -> Path:
    return GOLDEN / f"{name}_p{p}_m{m}_v{v}_b{batches}.txt"


def _render(name: str, p: int, m: int, v: int, batches: int) -> str:
    schedule = schedcc.get_schedule(name)(p, m, v, batches)
    return collect(schedule).to_text() + "\n"


@pytest.mark.parametrize("case", CASES, ids=lambda case: _path(*case).stem)
def test_compute_order_matches_golden(case):
    """The schedule's per-stage compute order is exactly the reviewed golden file."""
    assert _render(*case) == _path(*case).read_text()


@pytest.mark.parametrize("case", CASES, ids=lambda case: _path(*case).stem)
def test_golden_order_compiles_and_validates(case):
    """Every golden compute order lowers to a program that validates."""
    name, p, m, v, batches = case
    program = schedcc.compile(schedcc.get_schedule(name)(p, m, v, batches))
    assert program.num_stages == p


def _regenerate() -> None:
    GOLDEN.mkdir(exist_ok=True)
    for case in CASES:
        _path(*case).write_text(_render(*case))
        print("wrote", _path(*case))


if __name__ == "__main__":
    if sys.argv[1:]:
        sys.exit("usage: python tests/schedules/test_golden.py   (rewrites its golden/*.txt)")
    _regenerate()
