"""`schedcc run` end to end: local processes, data parallel with ZeRO, a user's schedule file,
bad input, and two torchrun launchers on 127.0.0.1 (the multi-node path)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _cli import run_cli

from schedcc import CostModel
from schedcc.backends.run.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _run(*args: str, timeout: float = 120, env=None) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=timeout, env=env or _env())


def test_run_trains_1f1b_and_prints_the_summary(tmp_path):
    """`schedcc run --schedule 1f1b --steps 3` trains and reports loss, floor, bubble, memory;
    its trace holds the steady runs, each compute with its own time, each receive its take."""
    trace = tmp_path / "trace.json"
    result = _run("--schedule", "1f1b", "--steps", "3", "--trace", str(trace))
    assert result.returncode == 0, result.stderr
    for text in ("entropy floor", "median step time", "bubble", "peak activations, stage 1"):
        assert text in result.stdout
    assert re.search(r"point-to-point\s*│\s*shared memory\s*│", result.stdout), result.stdout
    written = json.loads(trace.read_text())
    assert written["otherData"]["runs"] == 2  # the steady ones: every step but the first
    events = [e for e in written["traceEvents"] if e.get("ph") == "X"]
    assert sorted(e["tid"] for e in events if e["name"] == "F0") == [0, 0, 1, 1]
    for event in events:  # a compute's own time, a receive's take: inside its span
        args, kind = event["args"], event["args"]["kind"]
        computes, receives = kind in ("Forward", "Backward"), kind in ("RecvActivation", "RecvGrad")
        assert ("segment_us" in args) == computes, event
        assert ("take_us" in args) == receives, event
        if computes:
            assert 0 < args["segment_us"] < event["dur"], event
        if receives:
            assert 0 < args["take_us"] <= event["dur"], event
    costs = CostModel.from_trace(trace)
    assert all(costs.at(s).fixed_forward > 0 and costs.at(s).fixed_backward > 0 for s in (0, 1))
    assert all(costs.at(s).receive > 0 for s in (0, 1))


def test_run_with_data_parallel_zero_1_checks_equal_to_non_pipelined(tmp_path):
    """`--dp 2 --zero 1 --check` on 4 processes matches non-pipelined training in float64."""
    result = _run("--dp", "2", "--zero", "1", "--steps", "3", "--check", "--model", "mlp")
    assert result.returncode == 0, result.stderr
    assert "check: largest parameter difference" in result.stdout
    assert ": ok" in result.stdout


def test_run_accepts_a_schedule_from_a_user_file(tmp_path):
    """`--schedule file.py:Class` trains a schedule the user wrote, checked against the floor
    (with `--p2p gloo`: the default, shared memory, is what the other runs use)."""
    source = tmp_path / "my_schedules.py"
    source.write_text(
        textwrap.dedent(
            """
            from schedcc import Backward, Forward, Schedule

            class AllForwardAllBackward(Schedule):
                name = "afab"
                def order(self, stage):
                    mbs = self.microbatches(0)
                    yield from (Forward(i) for i in mbs)
                    yield from (Backward(i) for i in reversed(mbs))
            """
        )
    )
    result = _run(
        "--schedule",
        f"{source}:AllForwardAllBackward",
        "--steps",
        "3",
        "--check",
        "--model",
        "mlp",
        "--p2p",
        "gloo",
    )
    assert result.returncode == 0, result.stderr
    assert "AllForwardAllBackward(p=2, m=8)" in result.stdout
    assert ": ok" in result.stdout
    assert re.search(r"point-to-point\s*│\s*gloo\s*│", result.stdout), result.stdout


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (("--schedule", "no-such-schedule"), {}, "unknown schedule 'no-such-schedule'"),
        (("-p", "2", "--dp", "2"), {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}, "needs 4"),
        (("-p", "2"), {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}, "not a multiple"),
        (("--lr", "-1"), {}, "--lr must be a positive number"),
        (("--timeout", "nan"), {}, "--timeout must be a positive number"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, env, message):
    """A bad schedule, lr or timeout, or a world unlike p * dp: one line on stderr, exit 2."""
    result = _run(*args, env={**_env(), **env}, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def _refused(*args: str) -> str:
    """Run `schedcc run args`: it must end at once with one line on stderr, exit 2."""
    result = _run("--steps", "1", *args, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    return line


def test_sequence_parts_on_the_mlp_are_refused_before_training():
    """seq1f1b needs segments that take a carry; the built-in mlp's samples have no sequence:
    one line naming what it needs and the built-in that has one, exit 2, before any rank
    starts (not a split error on a rank). tiny-gpt trains on parts (tests/models)."""
    line = _refused("--schedule", "seq1f1b", "--model", "mlp")
    assert "2 sequence parts" in line
    assert "--model mlp has no sequence to split: use --model tiny-gpt" in line


@pytest.mark.parametrize("flag", [("--compile",), ("--recompute-layers", "2")])
def test_a_segment_call_flag_with_sequence_parts_is_refused_before_training(flag):
    """--compile and --recompute-layers apply a segment to one value, not to a part and its
    carry: with seq1f1b on tiny-gpt one line, exit 2, before any rank starts."""
    line = _refused("--schedule", "seq1f1b", *flag)
    assert f"{flag[0]} with --model tiny-gpt" in line
    assert "apply a segment to one value" in line


def test_a_trace_path_that_is_a_directory_is_refused_before_training(tmp_path):
    """--trace DIR (a directory, not a file) is one line, exit 2, before any rank starts."""
    assert "is a directory" in _refused("--trace", str(tmp_path))


def test_an_unwritable_checkpoint_directory_is_refused_before_training(tmp_path):
    """--checkpoint where nothing can be written is one line from the command, not errors from
    every rank after training."""
    (tmp_path / "file").write_text("")
    line = _refused("--checkpoint", str(tmp_path / "file" / "ckpt"))
    assert "is not a directory" in line
    if sys.platform.startswith("linux"):
        assert "cannot write in /proc" in _refused("--checkpoint", "/proc/ckpt")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert "cannot write in" in _refused("--checkpoint", str(locked / "ckpt"))


def test_two_torchrun_nodes_run_to_completion(tmp_path):
    """Two torchrun launchers (`--nnodes 2`, a node rank each, node 0 hosting the store on
    127.0.0.1) train together. Static ranks rather than c10d's elastic rendezvous: there both
    launchers race to host the store, which under load fails about once in a dozen runs."""
    port = free_port()
    command = [
        str(TORCHRUN),
        "--nnodes", "2",
        "--nproc-per-node", "1",
        "--master-addr", "127.0.0.1",
        "--master-port", str(port),
        "-m", "schedcc", "run", "--steps", "3", "--no-progress", "--timeout", "60",
    ]  # fmt: skip
    nodes = [
        subprocess.Popen(
            [*command[:1], "--node-rank", str(rank), *command[1:]],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    try:
        outputs = [node.communicate(timeout=150)[0].decode() for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert any("entropy floor" in out for out in outputs), outputs
