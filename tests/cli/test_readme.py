"""README.md is what a newcomer copies: every ```python block of it (and of docs/training.md)
runs, in order, in one namespace (a block right after `<!-- not run -->` needs processes or a GPU
and is skipped), and every relative link of README.md, docs/training.md and docs/cli.md names a
file (and a heading, for a `#anchor`) that exists."""

from __future__ import annotations

import code
import contextlib
import io
import re
from pathlib import Path

import pytest
import torch
from _cli import ROOT

README = ROOT / "README.md"
TRAINING = ROOT / "docs" / "training.md"
LINKED = [README, TRAINING, ROOT / "docs" / "cli.md", ROOT / "docs" / "migrating.md"]
#: a python block and the marker right above it, if any: `(marker, code)`
PYTHON_BLOCK = re.compile(r"(<!-- not run -->\n)?```python\n(.*?)```", re.S)
#: a Markdown link's target: `[text](target)`
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: the command CI runs, which README must keep word for word
TEST_COMMAND = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
    'pip install -e ".[test,hf]" && python -m pytest -n 2'
)


def _blocks(text: str) -> list[tuple[bool, str]]:
    """README's python blocks in order, each as `(runs, code)`."""
    return [(not marker, code) for marker, code in PYTHON_BLOCK.findall(text)]


def test_blocks_are_found_and_marked():
    """The parser sees a skipped block only where the marker is, and README has blocks to run."""
    text = "```python\nx = 1\n```\n<!-- not run -->\n```python\nraise SystemExit\n```\n"
    assert _blocks(text) == [(True, "x = 1\n"), (False, "raise SystemExit\n")]
    runs = [code for run, code in _blocks(README.read_text()) if run]
    assert len(runs) >= 3
    assert any("class GPipe(Schedule)" in code for code in runs)


def _run_blocks(doc: Path) -> None:
    """Run `doc`'s unmarked python blocks in order in one fresh namespace, on one thread (the
    machine's cores are shared), leaving torch's RNG, default dtype and threads as they were."""
    namespace: dict = {"__name__": "__doc_blocks__"}
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.random.fork_rng():
        try:
            for index, (run, code) in enumerate(_blocks(doc.read_text())):
                if run:
                    exec(compile(code, f"{doc.name} python block {index}", "exec"), namespace)
        finally:
            torch.set_default_dtype(dtype)
            torch.set_num_threads(threads)


def test_readme_python_blocks_run(capsys):
    """Every unmarked block runs after the ones before it, as pasted into one python session."""
    _run_blocks(README)
    out = capsys.readouterr().out
    assert "stage 0: F0 SA0 F1 SA1 RG1 B1 RG0 B0 Step" in out  # README's GPipe, as printed there
    final = float(re.search(r"loss after 50 steps: (\S+)", out).group(1))
    assert final < 0.1  # the first example trains


def test_training_guide_python_blocks_run(capsys):
    """docs/training.md's local-engine GPT example trains and evaluates as written."""
    _run_blocks(TRAINING)
    out = capsys.readouterr().out
    assert "step 19: loss" in out
    assert "torch.Size([16," in out  # predict's logits, a batch of 16


def test_readme_keeps_the_test_command():
    """CI runs README's test command, so it stays as it is."""
    assert TEST_COMMAND in README.read_text()


def _anchors(path: Path) -> set[str]:
    """The GitHub anchors of a Markdown file's headings."""
    anchors = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("doc", LINKED, ids=lambda p: p.name)
def test_relative_links_exist(doc):
    """Each relative link names an existing file, and its `#anchor` a heading of that file."""
    broken = []
    targets = [t for t in LINK.findall(doc.read_text()) if not re.match(r"[a-z]+:", t)]
    assert targets, f"{doc.name} links nowhere"
    for target in targets:
        name, _, anchor = target.partition("#")
        path = (doc.parent / name).resolve() if name else doc
        missing = not path.exists()
        if missing or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
            broken.append(target)
    assert not broken, f"{doc.name}: broken links {broken}"


def test_first_example_pastes_into_the_interactive_prompt():
    """README's first example, fed line by line to a `python` prompt (the classic one, where a
    blank line ends a block), trains as it does run as a file."""
    first = next(code for run, code in _blocks(README.read_text()) if run)
    console = code.InteractiveConsole({"__name__": "__console__"})
    errors = []
    console.write = errors.append  # the console reports a SyntaxError or traceback here
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(), contextlib.redirect_stdout(io.StringIO()) as out:
            for line in [*first.splitlines(), ""]:
                console.push(line)
    finally:
        torch.set_num_threads(threads)
    assert not errors, "".join(errors)
    assert "loss after 50 steps" in out.getvalue()
