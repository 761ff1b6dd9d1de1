"""docs/migrating.md and the examples it is cut from: every schedcc code block in the guide is
text of an example file, each example runs and checks its own numbers, and the Hugging Face
Llama of examples/hf_llama.py passes `schedcc run --check`."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _cli import ROOT, run_cli

GUIDE = ROOT / "docs" / "migrating.md"
#: a python block and the marker above it: `(marker, path of an example: block, code)`
MARKED_BLOCK = re.compile(
    r"(?:<!-- (example: (\S+)|for comparison) -->\n)?```python\n(.*?)```", re.S
)


def _load(path: str):
    """The example file at `path` (from the repository root), imported as a module."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def default_dtype():
    """Restore the default dtype an example sets."""
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


def _outside_torchrun() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def _losses(output: str, label: str) -> list[float]:
    return [float(v) for v in re.findall(rf"^{label} step \d+: loss (\S+)$", output, re.M)]


def test_every_python_block_of_the_guide_is_an_example_or_marked_for_comparison():
    """Each python block in docs/migrating.md is marked: an `example:` block is verbatim text of
    the file it names, a `for comparison` block (DeepSpeed's, torch's) at least parses."""
    blocks = MARKED_BLOCK.findall(GUIDE.read_text())
    assert len(blocks) >= 6, blocks
    examples = 0
    for marker, path, code in blocks:
        assert marker, f"a python block in {GUIDE.name} has no marker:\n{code}"
        if path:
            assert code in (ROOT / path).read_text(), f"not text of {path}:\n{code}"
            examples += 1
        else:
            ast.parse(code)
    assert examples >= 4


def test_from_deepspeed_trains_on_two_ranks_as_the_local_engine_does():
    """examples/from_deepspeed.py (2 gloo ranks, a builder, a tie, recompute, clipping, an LR
    schedule, a checkpoint exported by name) exits 0 and its pipeline losses equal the local
    engine's."""
    done = subprocess.run(
        [sys.executable, "examples/from_deepspeed.py"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**_outside_torchrun(), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    pipeline, local = _losses(done.stdout, "pipeline"), _losses(done.stdout, "local")
    assert len(pipeline) == len(local) == 4, done.stdout
    assert max(abs(a - b) for a, b in zip(pipeline, local)) < 1e-11, done.stdout
    assert "exported: 0.weight, 1.mlp.0.bias" in done.stdout


def test_from_torch_pipelining_trains_three_schedules_as_without_a_pipeline(default_dtype, capsys):
    """examples/from_torch_pipelining.py: 1f1b, interleaved-1f1b and zb-v, each cut by
    `schedcc.split`, give the losses of training without a pipeline."""
    example = _load("examples/from_torch_pipelining.py")
    assert example.main() == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    lines = dict(re.findall(r"^(.+): losses (.+)$", out, re.M))
    assert set(lines) == {"1f1b", "interleaved-1f1b", "zb-v", "no pipeline"}, out
    assert len(set(lines.values())) == 1, out


def test_the_llama_batches_are_padded_and_a_pure_function_of_the_step():
    """hf_llama.batch: lengths vary within and across steps, padding is masked and labelled
    -100, and a step's batch is drawn alike every time."""
    pytest.importorskip("transformers")
    llama = _load("examples/hf_llama.py")
    inputs, labels = llama.batch(8, 3)
    again, labels_again = llama.batch(8, 3)
    assert torch.equal(inputs["input_ids"], again["input_ids"])
    assert torch.equal(labels, labels_again)
    lengths = inputs["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) > 1
    assert torch.equal(lengths, (labels != -100).sum(1))
    widths = {llama.batch(8, step)[1].shape[1] for step in range(6)}
    assert len(widths) > 1


#: factory -> the objective `--check` names for it
LLAMA_RUNS = {"make": "token ratio, count known up front", "make_mean": "per-microbatch means"}


def test_the_guides_schedcc_run_lines_are_the_ones_tested():
    """Each `schedcc run` line in docs/migrating.md is one the Llama test below runs."""
    lines = re.findall(r"^schedcc run .*$", GUIDE.read_text(), re.M)
    tested = {f"schedcc run --model examples/hf_llama.py:{f} --check --steps 2" for f in LLAMA_RUNS}
    assert len(lines) == len(tested), lines
    assert set(lines) == tested, lines


@pytest.mark.parametrize(("factory", "objective"), LLAMA_RUNS.items())
def test_an_hf_llama_passes_schedcc_run_check(factory, objective):
    """`schedcc run --model examples/hf_llama.py:FACTORY --check --steps 2` trains the Llama
    cut by `schedcc.split` on 2 ranks and equals non-pipelined training within 1e-9, on the
    TokenLoss (despite the float32 RMSNorm) and on padded per-microbatch means."""
    pytest.importorskip("transformers")
    done = run_cli("--model", f"examples/hf_llama.py:{factory}", "--check", "--steps", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(rf"check: .*objective: {objective}\): ok", done.stdout), done.stdout
