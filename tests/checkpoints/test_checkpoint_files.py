"""Checkpoint files: atomic writes, a manifest last, and every refusal with its message."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from schedcc.backends.checkpoint import files as ckpt
from schedcc.errors import CheckpointError

META = {"schedule": "1f1b", "num_stages": 2, "num_chunks": 1, "data_parallel": 1, "zero": 0}


def _save(root: Path, step: int, value: float) -> Path:
    directory = ckpt.step_dir(root, step)
    files = {
        ckpt.shard_name(s, 0): ckpt.write_shard(directory, ckpt.shard_name(s, 0), _state(value))
        for s in range(2)
    }
    ckpt.write_manifest(directory, META, step, files)
    return directory


def _state(value: float) -> dict:
    return {"params": {"weight": torch.full((4, 4), value, dtype=torch.float64)}, "step": 3}


def _load(directory: Path) -> list[dict]:
    manifest = ckpt.read_manifest(directory)
    ckpt.verify_files(directory, manifest)
    return [ckpt.read_shard(directory, name, manifest) for name in sorted(manifest["files"])]


def test_round_trip(tmp_path):
    """A saved checkpoint loads back equal, and is the latest complete one."""
    directory = _save(tmp_path, 5, 1.5)
    assert ckpt.latest_checkpoint(tmp_path) == directory
    states = _load(directory)
    assert all(torch.equal(s["params"]["weight"], _state(1.5)["params"]["weight"]) for s in states)
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_no_manifest_is_incomplete(tmp_path):
    """Shards without a manifest are not a checkpoint: the previous one stays the latest."""
    first = _save(tmp_path, 1, 1.0)
    partial = ckpt.step_dir(tmp_path, 2)
    ckpt.write_shard(partial, ckpt.shard_name(0, 0), _state(2.0))
    assert ckpt.latest_checkpoint(tmp_path) == first
    with pytest.raises(CheckpointError, match=r"no manifest\.json"):
        ckpt.read_manifest(partial)


def test_missing_file_refused(tmp_path):
    """A file listed in the manifest but gone is named in the refusal."""
    directory = _save(tmp_path, 1, 1.0)
    (directory / ckpt.shard_name(1, 0)).unlink()
    with pytest.raises(CheckpointError, match=r"stage1-dp0\.pt is missing"):
        _load(directory)


def test_truncated_file_refused(tmp_path):
    """A truncated shard is refused by its size before anything is loaded."""
    directory = _save(tmp_path, 1, 1.0)
    path = directory / ckpt.shard_name(0, 0)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        _load(directory)


def test_altered_bytes_refused(tmp_path):
    """A shard with the same size but other bytes fails its checksum."""
    directory = _save(tmp_path, 1, 1.0)
    path = directory / ckpt.shard_name(0, 0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        _load(directory)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_pickle_that_runs_code_refused(tmp_path):
    """A shard that would execute code on unpickling is refused even with a matching manifest."""
    directory = _save(tmp_path, 1, 1.0)
    name = ckpt.shard_name(0, 0)
    (directory / name).write_bytes(pickle.dumps({"params": _RunsCode()}, protocol=2))
    manifest = ckpt.read_manifest(directory)
    manifest["files"][name] = {
        "size": (directory / name).stat().st_size,
        "sha256": ckpt._sha256(directory / name),
    }
    (directory / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        _load(directory)


def test_meta_mismatch_names_the_difference():
    """Another schedule or shape is refused with every differing field named."""
    other = dict(META, schedule="gpipe", num_stages=4)
    with pytest.raises(CheckpointError, match="num_stages: checkpoint 2, program 4") as info:
        ckpt.check_meta(META, other)
    assert "schedule: checkpoint '1f1b', program 'gpipe'" in str(info.value)


def test_meta_elastic_keys_allowed():
    """A change in data-parallel degree or ZeRO alone is accepted (the loader re-shards)."""
    ckpt.check_meta(META, dict(META, data_parallel=2, zero=1))


def test_bad_manifest_refused(tmp_path):
    """A manifest that is not JSON, or not ours, is refused with one line."""
    (tmp_path / ckpt.MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        ckpt.read_manifest(tmp_path)
    (tmp_path / ckpt.MANIFEST).write_text(json.dumps({"format": 99}))
    with pytest.raises(CheckpointError, match="format 1"):
        ckpt.read_manifest(tmp_path)


def test_kill_during_save_keeps_previous(tmp_path):
    """A process killed in the middle of a save leaves the previous checkpoint loadable."""
    script = textwrap.dedent(
        f"""
        import time, torch
        from schedcc.backends.checkpoint import files as ckpt
        root = {str(tmp_path)!r}
        def save(step, slow):
            d = ckpt.step_dir(root, step)
            files = {{}}
            for s in range(4):
                name = ckpt.shard_name(s, 0)
                files[name] = ckpt.write_shard(d, name, {{"w": torch.full((64, 64), float(step))}})
                if slow:
                    print("shard", flush=True)
                    time.sleep(30)
            ckpt.write_manifest(d, {{"schedule": "1f1b"}}, step, files)
        save(1, False)
        save(2, True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "shard"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    time.sleep(0.1)
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest == ckpt.step_dir(tmp_path, 1)
    states = _load(latest)
    assert all(torch.equal(s["w"], torch.full((64, 64), 1.0)) for s in states)
