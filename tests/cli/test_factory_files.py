"""`--model path/to/file.py:make` (and `--schedule file.py:Class`) imports the file with its
folder on `sys.path`, so a factory file imports the helper module beside it: in the process
that loads it and in `schedcc run`'s ranks, started by the `schedcc` command from another
folder. The folder is on the path only while the file is imported."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from schedcc.backends.run import models
from schedcc.cli import main

HELPER = textwrap.dedent(
    """
    import torch
    from torch import nn

    WIDTH = 8


    def layers(num_segments, seed):
        torch.manual_seed(seed)
        return [nn.Linear(WIDTH, WIDTH) for _ in range(num_segments)]


    def warmup(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    """
)

FACTORY = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F

    import lr_helper
    from schedcc.backends.run.models import RunModel


    def make(num_segments, *, seed):
        def batch(batch_size, step):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(batch_size, lr_helper.WIDTH, generator=gen)
            return x, x.flip(1)

        segments = lr_helper.layers(num_segments, seed)
        return RunModel(segments, F.mse_loss, batch, lr_scheduler=lr_helper.warmup)
    """
)


def _write(folder: Path) -> Path:
    folder.mkdir()
    (folder / "lr_helper.py").write_text(HELPER)
    (folder / "lr_factory.py").write_text(FACTORY)
    return folder / "lr_factory.py"


def test_a_factory_file_imports_the_module_beside_it(tmp_path):
    """`models.factory("dir/file.py:make")` imports a file that imports its neighbour, from a
    process whose path lacks the folder; the path is as it was after."""
    path = _write(tmp_path / "models")
    before = list(sys.path)
    try:
        make = models.factory(f"{path}:make")
        model = make(2, seed=0)
    finally:
        sys.modules.pop("lr_helper", None)
    assert model.lr_scheduler.__name__ == "warmup"
    assert sys.path == before


def test_the_schedcc_command_runs_a_factory_file_beside_its_helper(tmp_path):
    """`schedcc run --model models/lr_factory.py:make --check` started from the folder above,
    with the `schedcc` command: the file imports its helper on every rank, the model's own
    LambdaLR warmup steps on every rank, and the run equals the non-pipelined loop stepping
    the same scheduler."""
    path = _write(tmp_path / "models")
    command = Path(sys.executable).parent / "schedcc"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(
        [
            str(command),
            "run",
            "--no-progress",
            "--model",
            f"models/{path.name}:make",
            "-p",
            "2",
            "-m",
            "2",
            "--steps",
            "4",
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"check: .*: ok", result.stdout), result.stdout


def test_a_schedule_flag_beside_the_models_own_scheduler_is_one_line(tmp_path, capsys):
    """--warmup (or --lr-schedule cosine) beside a model that brings its own lr_scheduler: one
    line naming both, exit 2, before any rank."""
    path = _write(tmp_path / "models")
    try:
        code = main(
            [
                "run",
                "--no-progress",
                "--steps",
                "2",
                "--model",
                f"{path}:make",
                "-m",
                "2",
                "--warmup",
                "1",
            ]
        )
    finally:
        sys.modules.pop("lr_helper", None)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert "brings its own lr_scheduler" in line
