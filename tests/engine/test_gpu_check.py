"""benchmarks/gpu_check.py runs on the CPU (`--smoke`): a GPU session spends its minutes on
measuring, not on a script that broke since it last ran."""

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("gpu_check")
    yield module
    sys.modules.pop("gpu_check", None)


def test_smoke_run_checks_every_builtin_and_counts_syncs(gpu_check, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--smoke", "--only", "exact", "syncs"])
    assert gpu_check.main() == 0
    out = capsys.readouterr().out
    compared = [line for line in out.splitlines() if line.startswith("local backend ")]
    assert [line.split()[2] for line in compared] == list(gpu_check.SHAPES)
    assert all("params 0.00e+00, losses 0.00e+00" in line for line in compared)
    assert "read_loss=True: syncs per step (CUDA's count, the engine's) [(None, 1)," in out
    assert "read_loss=False: syncs per step (CUDA's count, the engine's) [(None, 0)," in out
    assert out.rstrip().endswith("PASS")


def test_a_failing_part_is_reported_and_the_rest_still_run(gpu_check, monkeypatch, capsys):
    def broken():
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(gpu_check, "local_on_cuda", broken)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--smoke", "--only", "exact", "syncs"])
    assert gpu_check.main() == 1
    captured = capsys.readouterr()
    assert "RuntimeError: no such kernel" in captured.err
    assert "CUDA against CPU: FAILED (above)" in captured.out
    assert "read_loss=False: syncs per step" in captured.out  # the next part ran
    assert captured.out.rstrip().endswith("FAIL: CUDA against CPU")
