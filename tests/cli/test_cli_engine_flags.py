"""`schedcc run --max-grad-norm`, `--precision`, `--p2p broadcast` and `--tp`: they train,
`--check` holds with clipping and tensor parallelism, and the summary shows the norm, the skipped
steps and the precision."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from _cli import run_cli

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=timeout)


def test_run_clips_a_tensor_parallel_gpt_over_broadcast_pairs_as_non_pipelined():
    """`--tp 2 --max-grad-norm 0.1 --p2p broadcast --check` (4 processes): every shard of the
    tiny GPT split Megatron-style (attention by heads, MLPs by columns and rows) equals that shard
    of dense non-pipelined training clipped by clip_grad_norm_, through broadcasts; the summary
    names the norm and the transport."""
    flags = ("--tp", "2", "--max-grad-norm", "0.1", "--p2p", "broadcast")
    result = _run("--steps", "2", *flags, "--check")
    assert result.returncode == 0, result.stderr
    assert ": ok" in result.stdout
    assert re.search(r"grad norm: last\s*│\s*[\d.]+ \(max 0.1\)", result.stdout), result.stdout
    assert re.search(r"skipped steps \(inf/nan\)\s*│\s*0\s*│", result.stdout)
    assert re.search(r"point-to-point\s*│\s*broadcast\s*│", result.stdout)
    assert re.search(r"precision\s*│\s*fp32\s*│", result.stdout)


def test_seq1f1b_trains_a_tensor_parallel_gpt_on_parts_as_non_pipelined():
    """`--schedule seq1f1b --tp 2 --check` (4 processes): each rank's heads carry their own
    keys and values from part to part, and every shard equals that shard of dense
    non-pipelined training of the whole sequences."""
    result = _run("--schedule", "seq1f1b", "-m", "4", "--tp", "2", "--steps", "2", "--check")
    assert result.returncode == 0, result.stderr
    assert re.search(r"check: largest parameter difference .*: ok", result.stdout)


def test_bad_engine_flags_are_one_line_and_exit_2():
    """A negative norm, --check with bf16 (it compares float64 training), or --tp 3 (the GPT's
    4 heads do not split 3 ways) is one readable line and exit 2, before any rank starts."""
    for bad in (["--max-grad-norm", "-1"], ["--precision", "bf16", "--check"], ["--tp", "3"]):
        result = _run("--steps", "1", *bad)
        assert result.returncode == 2
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr
