"""docs/design.md's feature map cannot drift: every path in it is a file of the tree, every
`module.name` in it imports, every instruction, validator rule and pass appears in it, and each
column holds what its heading says."""

from __future__ import annotations

import importlib
import re

import pytest
from _cli import ROOT

from schedcc import ir
from schedcc.passes import PASSES, collect, insert_recompute
from schedcc.validate import RULES

DESIGN = ROOT / "docs" / "design.md"
COLUMNS = ("feature", "IR class", "pass", "validator rule", "runtime handler", "tests")
#: a name or path in backticks
QUOTED = re.compile(r"`([^`]+)`")


def _feature_map(text: str) -> list[dict[str, list[str]]]:
    """The rows of the table under `## Feature map`, each as {column: [quoted names]}."""
    section = text.split("\n## Feature map\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    heading = tuple(cell.strip() for cell in lines[0].strip("|").split("|"))
    assert heading == COLUMNS, f"the feature map's columns are {heading}, not {COLUMNS}"
    rows = []
    for line in lines[2:]:  # past the heading and its |---| line
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert len(cells) == len(COLUMNS), f"a row needs {len(COLUMNS)} cells: {line}"
        for cell in cells[1:]:
            names = QUOTED.findall(cell)
            leftover = QUOTED.sub("", cell).replace(",", "").strip()
            assert leftover in ("", "—"), f"a cell holds quoted names or '—': {cell!r}"
            assert names or leftover == "—", f"an empty cell should say '—': {line}"
        rows.append(dict(zip(COLUMNS, [[cells[0]], *map(QUOTED.findall, cells[1:])])))
    return rows


ROWS = _feature_map(DESIGN.read_text())


def _names(column: str) -> list[str]:
    return [name for row in ROWS for name in row[column]]


def _resolve(name: str) -> object:
    """What a dotted name refers to: the longest importable module, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            found: object = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module_name.startswith(exc.name):
                raise
            continue
        for attr in parts[cut:]:
            found = getattr(found, attr)
        return found
    raise ModuleNotFoundError(name)


def test_the_parser_reads_a_small_map():
    """A two-row table parses into its cells' names, and '—' into no name."""
    text = (
        "\n## Feature map\n\n| " + " | ".join(COLUMNS) + " |\n|---|---|---|---|---|---|\n"
        "| a | `x.Y` | — | `r` | `p/q.py`, `m.n` | `tests/t.py` |\n## Next\n| not | read |\n"
    )
    assert _feature_map(text) == [
        {
            "feature": ["a"],
            "IR class": ["x.Y"],
            "pass": [],
            "validator rule": ["r"],
            "runtime handler": ["p/q.py", "m.n"],
            "tests": ["tests/t.py"],
        }
    ]


@pytest.mark.parametrize(
    "name", sorted({n for row in ROWS for c in COLUMNS[1:] for n in row[c] if "/" not in n})
)
def test_every_name_in_the_map_imports(name):
    """Each `module.name` of the map is an importable module or an attribute of one."""
    assert name.startswith("schedcc."), f"{name}: write the import path, from schedcc"
    try:
        _resolve(name)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"docs/design.md's feature map names {name}, which does not exist: {exc}")


@pytest.mark.parametrize(
    "path", sorted({n for row in ROWS for c in COLUMNS[1:] for n in row[c] if "/" in n})
)
def test_every_path_in_the_map_exists(path):
    """Each path of the map is a file of the tree."""
    assert (ROOT / path).is_file(), f"docs/design.md's feature map names {path}, not a file"


def test_every_test_cell_names_test_files():
    """The tests column names files under tests/, and every row has one."""
    for row in ROWS:
        assert row["tests"], f"{row['feature'][0]}: no test named"
        for path in row["tests"]:
            assert re.fullmatch(r"tests/[a-z]+/test_\w+\.py", path), f"{path}: not a test file"
            assert path.endswith(".py"), f"{path}: not a test file"


def test_every_instruction_is_mapped_as_an_ir_class():
    """Each instruction class of `schedcc.ir` is in the IR column, and that column's
    `schedcc.ir` names are instruction classes."""
    mapped = {_resolve(name) for name in _names("IR class") if name.startswith("schedcc.ir.")}
    assert all(isinstance(cls, type) and issubclass(cls, ir.Instruction) for cls in mapped)
    missing = {cls.__name__ for cls in (*ir.COMPUTE, *ir.COMM, *ir.UPDATE)} - {
        cls.__name__ for cls in mapped
    }
    assert not missing, f"instructions missing from docs/design.md's feature map: {missing}"


def test_the_rule_column_is_the_validators_table():
    """The validator rule column holds exactly the rules of `validate.RULES`."""
    mapped = {_resolve(name) for name in _names("validator rule")}
    assert mapped == set(RULES), (
        f"not in validate.RULES: {mapped - set(RULES)}; "
        f"missing from the map: {[r.__name__ for r in set(RULES) - mapped]}"
    )


def test_every_pass_is_mapped():
    """Each compiler pass (`collect`, `insert_recompute` and `PASSES`) is in the pass column,
    by its module."""
    passes = {f"schedcc.passes.{f.__name__}" for f in (collect, insert_recompute, *PASSES)}
    missing = passes - set(_names("pass"))
    assert not missing, f"passes missing from docs/design.md's feature map: {sorted(missing)}"
