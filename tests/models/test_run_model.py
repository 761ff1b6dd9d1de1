"""`schedcc run --model`: the factory contract (`RunModel`), the built-in tied GPT, a user's file
and module, and bad factories refused in one line before any rank starts."""

from __future__ import annotations

import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from _cli import run_cli

from schedcc.backends.run import models
from schedcc.backends.run.gpt import IGNORE_INDEX
from schedcc.backends.run.models import RunModel
from schedcc.backends.runtime.tied import tied_groups
from schedcc.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "char_lm.py"


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=timeout)


def _row(stdout: str, metric: str) -> str:
    """The value of one row of the summary table."""
    match = re.search(rf"│ {re.escape(metric)}\s*│\s*(.*?)\s*│", stdout)
    assert match, stdout
    return match.group(1)


def test_the_built_in_gpt_is_tied_and_has_variable_lengths():
    """tiny-gpt: the head is the token embedding's Parameter (a tie between the first and the
    last segment), the batch length changes from step to step, and the throughput counts the
    real tokens only."""
    model = models.build("tiny-gpt", 4)
    assert tied_groups(model.segments) == [(0, 3)]
    lengths = set()
    for step in range(6):
        (tokens, pad_mask), targets = model.batch(8, step)
        lengths.add(tokens.shape[1])
        assert pad_mask.dtype == torch.bool
        assert model.size((tokens, pad_mask), targets) == int((targets != IGNORE_INDEX).sum())
    assert len(lengths) > 1
    assert 0 < model.floor < torch.log(torch.tensor(64.0))


def test_the_default_run_finds_the_tie_and_equals_non_pipelined_training():
    """`schedcc run --check --eval-every 3` on the built-in GPT (tuple boundaries, tied head,
    variable lengths): compiled with the tie it found, equal to non-pipelined training in
    float64, and so is its loss on held-out batches, evaluated through the pipeline."""
    result = _run("--check", "--steps", "3", "--eval-every", "3")
    assert result.returncode == 0, result.stderr
    assert _row(result.stdout, "tied segments (ReduceTied)") == "(0, 1)"
    assert _row(result.stdout, "eval loss: step 3 -> 3")  # held-out batches, forward only
    assert re.search(r"check: final evaluation loss difference .*: ok", result.stdout)
    assert "entropy floor" in result.stdout
    assert "tokens/s" in result.stdout
    assert re.search(r"check: .*: ok", result.stdout), result.stdout


def test_dualpipe_trains_the_gpt_on_its_token_loss():
    """`schedcc run --schedule dualpipe --dp 2 --zero 3 --check` (4 processes): the built-in
    GPT's (loss_sum, count) token loss over two model replicas, each carrying its own token
    count, with the replicas and the head tied under ZeRO-3, equals non-pipelined training."""
    result = _run("--schedule", "dualpipe", "--dp", "2", "--zero", "3", "--check", "--steps", "2")
    assert result.returncode == 0, result.stderr
    assert _row(result.stdout, "tied segments (ReduceTied)") == "(0, 1, 2, 3)"
    assert re.search(r"check: .*: ok", result.stdout), result.stdout


def test_seq1f1b_trains_the_gpt_on_sequence_parts_and_checks():
    """`schedcc run --schedule seq1f1b -k 4 --check` on the built-in GPT: each microbatch cut
    into 4 sequence parts (batches padded to a multiple of 4), the segments handing their
    carry on, equal to non-pipelined training of the whole sequences, and so is the held-out
    loss."""
    result = _run(
        "--schedule", "seq1f1b", "-p", "2", "-m", "4", "-k", "4", "--steps", "2", "--check",
        "--eval-every", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "parts=4" in result.stdout
    assert re.search(r"check: largest parameter difference .*: ok", result.stdout)
    assert re.search(r"check: final evaluation loss difference .*: ok", result.stdout)


def test_a_model_from_a_file_trains_interleaved_and_checks(tmp_path):
    """--model examples/char_lm.py:make (cut by schedcc.split, tied head, its own AdamW) under
    interleaved 1F1B (v = 2): the tie spans segments 0 and 3 on two ranks, --check holds, the
    trace is written and the throughput is in the model's unit."""
    trace = tmp_path / "trace.json"
    result = _run(
        "--model",
        f"{EXAMPLE}:make",
        "--schedule",
        "interleaved-1f1b",
        "-v",
        "2",
        "-m",
        "4",
        "--steps",
        "2",
        "--check",
        "--trace",
        str(trace),
    )
    assert result.returncode == 0, result.stderr
    assert _row(result.stdout, "tied segments (ReduceTied)") == "(0, 3)"
    assert "characters/s" in result.stdout
    assert "Tied0" in trace.read_text()
    assert re.search(r"check: .*: ok", result.stdout), result.stdout


def test_a_factory_is_found_by_module_or_by_name():
    """--model package.module:make imports the module; the built-in names are factories too."""
    assert models.factory("schedcc.backends.run.models:mlp") is models.mlp
    assert models.factory("tiny-gpt") is models.tiny_gpt


BAD = textwrap.dedent(
    """
    import torch
    from torch import nn
    from schedcc.backends.run.models import RunModel

    def data(batch_size, step):
        return torch.randn(batch_size, 2), torch.randn(batch_size, 2)

    def returns_a_list(num_segments, *, seed):
        return [nn.Linear(2, 2) for _ in range(num_segments)]

    def raises(num_segments, *, seed):
        raise RuntimeError("no GPU here\\nsecond line")

    def one_segment(num_segments, *, seed):
        return RunModel([nn.Linear(2, 2)], torch.nn.functional.mse_loss, data)

    def not_a_loss(num_segments, *, seed):
        return RunModel([nn.Linear(2, 2)] * num_segments, "mse", data)

    def odd_batch(num_segments, *, seed):
        def batch(batch_size, step):
            return data(batch_size + 1, step)
        return RunModel([nn.Linear(2, 2)] * num_segments, torch.nn.functional.mse_loss, batch)

    def odd_sequence(num_segments, *, seed):
        def batch(batch_size, step):
            x = torch.randn(batch_size, 3, 2)
            return x, x
        return RunModel([nn.Linear(2, 2)] * num_segments, torch.nn.functional.mse_loss, batch)

    def no_seed(num_segments):
        pass

    def own_optimizer(num_segments, *, seed):
        return RunModel(
            [nn.Linear(2, 2) for _ in range(num_segments)],
            torch.nn.functional.mse_loss,
            data,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        )

    def odd_held_out(num_segments, *, seed):
        def held_out(batch_size, k):
            return data(batch_size - 1, k)
        return RunModel(
            [nn.Linear(2, 2) for _ in range(num_segments)],
            torch.nn.functional.mse_loss,
            data,
            eval_batch=held_out,
        )

    NOT_CALLABLE = 3
    """
)


@pytest.mark.parametrize(
    ("target", "extra", "says"),
    [
        ("missing.py:make", (), "file 'missing.py' does not exist"),
        ("bad.py:nothing", (), "bad.py has no attribute 'nothing'"),
        ("bad.py:NOT_CALLABLE", (), "an object of type 'int', not a function"),
        ("no_such_module_xyz:make", (), "cannot import no_such_module_xyz"),
        ("gpt2", (), "not a built-in model (tiny-gpt, mlp)"),
        ("bad.py:returns_a_list", (), "returned a list, not a RunModel"),
        ("bad.py:raises", (), "raises(2, seed=0) raised RuntimeError: no GPU here"),
        ("bad.py:one_segment", (), "returned 1 segment(s); the schedule needs p*v = 2"),
        ("bad.py:not_a_loss", (), "raised TypeError: RunModel.loss_fn must be a callable"),
        ("bad.py:odd_batch", (), "batch(16, 0): 17 samples cannot be split into m=8"),
        (
            "bad.py:odd_sequence",
            ("--schedule", "seq1f1b"),
            "shape (4, 3, 2), which does not split into 2 equal sequence parts",
        ),
        ("bad.py:no_seed", (), "unexpected keyword argument 'seed'"),
        ("bad.py:own_optimizer", ("--lr", "0.1"), "brings its own optimizer"),
        ("bad.py:own_optimizer", ("--eval-every", "1"), "has no held-out data"),
        ("bad.py:odd_held_out", ("--eval-every", "1"), "eval_batch(16, 0): 15 samples"),
    ],
)
def test_a_bad_model_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, target, extra, says):
    """A missing file, module or attribute, an unknown name, a factory that raises, returns
    something other than a RunModel or breaks its contract, a batch or held-out batch that does
    not split (into microbatches, or into sequence parts), --eval-every without held-out data,
    or --lr beside the model's own optimizer: one line naming --model, exit 2, before any
    rank."""
    (tmp_path / "bad.py").write_text(BAD)
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--no-progress", "--steps", "1", "--model", target, *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert says in line
    assert "--model" in line or "--lr" in line


def test_eval_every_falls_between_program_runs(capsys):
    """2BW runs four steps a program run; --eval-every 2 would fall inside one: one line, exit 2."""
    code = main(["run", "--schedule", "2bw", "--steps", "8", "--eval-every", "2"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert "--eval-every 2: evaluations run between program runs" in line
    assert "use a multiple of 4" in line


def test_run_model_checks_its_fields():
    """RunModel refuses a field of the wrong kind where the factory builds it."""
    segments = [torch.nn.Linear(2, 2)]
    with pytest.raises(TypeError, match=r"RunModel\.batch must be a callable"):
        RunModel(segments, torch.nn.functional.mse_loss, None)  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(segments[0].parameters(), lr=0.1)
    with pytest.raises(TypeError, match="not an optimizer"):
        RunModel(segments, torch.nn.functional.mse_loss, len, optimizer=optimizer)
    with pytest.raises(TypeError, match=r"RunModel\.floor must be None or a number"):
        RunModel(segments, torch.nn.functional.mse_loss, len, floor="low")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"RunModel\.eval_batch must be None or a callable"):
        RunModel(segments, torch.nn.functional.mse_loss, len, eval_batch=[])  # type: ignore[arg-type]
