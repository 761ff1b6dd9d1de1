"""A checkpoint that does not fit is refused before anything changes (local backend).

Each test alters one thing in a real checkpoint, loads it into an engine that has trained (so it
has optimizer state), and checks: `CheckpointError` naming the problem, the engine's parameters,
optimizer state, RNG state and step count bitwise as they were, and training goes on exactly as
in a twin engine that never tried the load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import schedcc
from schedcc.backends.checkpoint import files as ckpt
from schedcc.backends.local import Engine
from schedcc.errors import CheckpointError

WIDTH = 6


def _engine(seed=0, *, dp=1, zero=0, optimizer=None):
    torch.manual_seed(seed)
    layers = []
    for _ in range(2):
        layers += [torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64), torch.nn.Tanh()]
    segments = schedcc.partition(torch.nn.Sequential(*layers), 2, method="uniform")
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2), data_parallel=dp, zero=zero)
    make = optimizer or (lambda params: torch.optim.Adam(params, lr=0.01))
    return Engine(program, segments, torch.nn.functional.mse_loss, make), segments


def _data(n, seed=123):
    gen = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(4, WIDTH, generator=gen, dtype=torch.float64) for _ in range(2))
        for _ in range(n)
    ]


def _saved(directory: Path, **kwargs) -> Path:
    """A real checkpoint of an engine trained one batch."""
    engine, _ = _engine(**kwargs)
    list(engine.train(_data(1)))
    engine.save(directory)
    return directory


def _trained(**kwargs):
    """An engine with other weights, trained one batch: it has optimizer state to keep."""
    engine, segments = _engine(seed=7, **kwargs)
    list(engine.train(_data(1, seed=5)))
    return engine, segments


def _snapshot(engine, segments) -> dict:
    optimizers = [
        rt.optimizer.state_dict()["state"] for runtimes in engine.runtimes for rt in runtimes
    ]
    return {
        "params": [t.detach().clone() for seg in segments for t in seg.state_dict().values()],
        "optimizer": [
            {k: {n: v.clone() for n, v in entry.items()} for k, entry in state.items()}
            for state in optimizers
        ],
        "rng": torch.get_rng_state(),
        "steps": engine.steps,
    }


def _assert_same(before: dict, after: dict) -> None:
    assert after["steps"] == before["steps"]
    assert torch.equal(after["rng"], before["rng"])
    for a, b in zip(before["params"], after["params"], strict=True):
        assert torch.equal(a, b)
    for left, right in zip(before["optimizer"], after["optimizer"], strict=True):
        assert left.keys() == right.keys()
        for key in left:
            assert left[key].keys() == right[key].keys()
            assert all(torch.equal(left[key][n], right[key][n]) for n in left[key])


def _assert_refused(directory: Path, match: str, **kwargs) -> None:
    """Loading `directory` is refused, changes nothing, and training then goes on exactly."""
    engine, segments = _trained(**kwargs)
    twin, twin_segments = _trained(**kwargs)
    before = _snapshot(engine, segments)
    with pytest.raises(CheckpointError, match=match):
        engine.load(directory)
    _assert_same(before, _snapshot(engine, segments))
    assert list(engine.train(_data(2, seed=9))) == list(twin.train(_data(2, seed=9)))
    _assert_same(_snapshot(twin, twin_segments), _snapshot(engine, segments))


def _edit_manifest(directory: Path, edit) -> None:
    path = directory / ckpt.MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _edit_shard(directory: Path, name: str, edit) -> None:
    """Change one shard's contents and give the manifest its new size and checksum."""
    path = directory / name
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    entry = {"size": path.stat().st_size, "sha256": ckpt._sha256(path)}
    _edit_manifest(directory, lambda manifest: manifest["files"].update({name: entry}))


STAGE1 = ckpt.shard_name(1, 0)


# -- the manifest --------------------------------------------------------------------------------


def test_manifest_entry_without_size_refused(tmp_path):
    """A file entry that lacks its size is refused (not a KeyError)."""
    directory = _saved(tmp_path / "c")
    _edit_manifest(directory, lambda m: m["files"][STAGE1].pop("size"))
    _assert_refused(directory, r"the entry of stage1-dp0\.pt has no size")


def test_manifest_entry_without_sha256_refused(tmp_path):
    """A file entry that lacks its checksum is refused."""
    directory = _saved(tmp_path / "c")
    _edit_manifest(directory, lambda m: m["files"][STAGE1].pop("sha256"))
    _assert_refused(directory, r"the entry of stage1-dp0\.pt has no sha256")


def test_manifest_files_not_an_object_refused(tmp_path):
    """`files` that is a list rather than an object of entries is refused."""
    directory = _saved(tmp_path / "c")
    _edit_manifest(directory, lambda m: m.update(files=sorted(m["files"])))
    _assert_refused(directory, "files is a list, not an object of file entries")


def test_manifest_entry_outside_the_checkpoint_refused(tmp_path):
    """A file entry naming a path outside the checkpoint directory is refused."""
    directory = _saved(tmp_path / "c")
    _edit_manifest(directory, lambda m: m["files"].update({"../x.pt": m["files"][STAGE1]}))
    _assert_refused(directory, r"'\.\./x\.pt' is not a file name in the checkpoint")


def test_meta_of_the_wrong_type_refused(tmp_path):
    """`meta` that is a string rather than an object is refused (not an AttributeError)."""
    directory = _saved(tmp_path / "c")
    _edit_manifest(directory, lambda m: m.update(meta="1f1b"))
    _assert_refused(directory, "meta is a str, not an object")


def test_meta_data_parallel_of_the_wrong_type_refused(tmp_path):
    """An elastic field of the wrong type (data_parallel "1") is refused (not a TypeError)."""
    directory = _saved(tmp_path / "c")
    _edit_manifest(directory, lambda m: m["meta"].update(data_parallel="1"))
    _assert_refused(directory, "meta data_parallel is '1', not an integer >= 1")


@pytest.mark.parametrize("step", ["abc", -1, True, 2.5, None])
def test_step_that_is_not_a_count_refused(tmp_path, step):
    """A step count that is not a non-negative integer is refused, not taken as the step."""
    directory = _saved(tmp_path / "c")
    _edit_manifest(directory, lambda m: m.update(step=step))
    _assert_refused(directory, "not a count of optimizer steps")


# -- the shards' contents ------------------------------------------------------------------------


def test_parameter_of_another_shape_refused(tmp_path):
    """A parameter with the right size but another shape (stage 1, after stage 0 would have
    loaded) is refused before stage 0 changes."""
    directory = _saved(tmp_path / "c")

    def reshape(state):
        weight = state["modules"][0]["2.weight"]
        state["modules"][0]["2.weight"] = weight.reshape(-1)[: WIDTH * WIDTH].reshape(
            WIDTH * 2, WIDTH // 2
        )

    _edit_shard(directory, STAGE1, reshape)
    _assert_refused(directory, r"2\.weight is \(12, 3\) torch.float64, this model's \(6, 6\)")


def test_parameter_of_another_dtype_refused(tmp_path):
    """A float32 parameter for a float64 model is refused, not silently cast."""
    directory = _saved(tmp_path / "c")
    _edit_shard(directory, STAGE1, lambda s: s["modules"][0].update({"2.bias": torch.zeros(6)}))
    _assert_refused(directory, r"2\.bias is \(6,\) torch.float32")


def test_optimizer_state_of_another_shape_refused(tmp_path):
    """An Adam moment of another shape than its parameter is refused (it used to load, and
    fail at the next step)."""
    directory = _saved(tmp_path / "c")

    def reshape(state):
        entry = state["optimizer"]["state"][0]
        entry["exp_avg"] = entry["exp_avg"].reshape(-1)

    _edit_shard(directory, STAGE1, reshape)
    _assert_refused(directory, r"optimizer state 'exp_avg' of parameter 0 has shape \(36,\)")


def test_optimizer_of_another_kind_refused(tmp_path):
    """SGD's state loaded into Adam is refused by its hyperparameters' names."""
    directory = _saved(
        tmp_path / "c", optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    )
    _assert_refused(directory, "the optimizer was another kind")


def test_rng_state_that_cannot_be_restored_refused(tmp_path):
    """A CPU RNG state of the wrong size is refused before any weight is loaded."""
    directory = _saved(tmp_path / "c")
    _edit_shard(
        directory, STAGE1, lambda s: s["rng"].update(cpu=torch.zeros(10, dtype=torch.uint8))
    )
    _assert_refused(directory, "its CPU RNG state cannot be restored")


def test_shard_without_its_identity_refused(tmp_path):
    """A shard that does not record its stage is refused."""
    directory = _saved(tmp_path / "c")
    _edit_shard(directory, STAGE1, lambda s: s.pop("stage"))
    _assert_refused(directory, r"stage1-dp0\.pt: stage is missing")


def _swap(directory: Path, a: str, b: str) -> None:
    """Exchange two shard files and their manifest entries (every checksum still matches)."""
    first, second = (directory / a).read_bytes(), (directory / b).read_bytes()
    (directory / a).write_bytes(second)
    (directory / b).write_bytes(first)

    def swap(manifest):
        files = manifest["files"]
        files[a], files[b] = files[b], files[a]

    _edit_manifest(directory, swap)


def test_shards_swapped_between_stages_refused(tmp_path):
    """Stage 0's and stage 1's shards exchanged (same shapes, so they used to load) are
    refused by the stage and segments each records."""
    directory = _saved(tmp_path / "c")
    _swap(directory, ckpt.shard_name(0, 0), STAGE1)
    _assert_refused(
        directory, r"stage0-dp0\.pt holds stage 1 \(segments \[1\]\) but is loaded as stage 0"
    )


def test_shards_swapped_between_data_parallel_ranks_refused(tmp_path):
    """Two data-parallel ranks' ZeRO shards exchanged are refused by the rank each records."""
    directory = _saved(tmp_path / "c", dp=2, zero=1)
    _swap(directory, ckpt.shard_name(0, 0), ckpt.shard_name(0, 1))
    _assert_refused(
        directory,
        r"stage0-dp0\.pt holds data-parallel rank 1 of 2 but is loaded as rank 0",
        dp=2,
        zero=1,
    )


def test_a_fitting_checkpoint_still_loads(tmp_path):
    """The checks refuse nothing a real save wrote: the trained engine takes the checkpoint."""
    directory = _saved(tmp_path / "c")
    engine, segments = _trained()
    engine.load(directory)
    expected, expected_segments = _engine()
    list(expected.train(_data(1)))
    assert engine.steps == 1
    _assert_same(_snapshot(expected, expected_segments), _snapshot(engine, segments))
