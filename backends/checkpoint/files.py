"""Checkpoint files: one per (stage, data-parallel rank), a manifest last, all writes atomic.

Layout of a checkpoint directory `DIR/step-00000042/`:

    manifest.json        schedule and shape, the cut (`cut_of`), step count, every file with
                         its size and sha256
    stage0-dp0.pt        what stage 0 of data-parallel rank 0 holds between runs: its chunks'
    stage1-dp0.pt        parameters and buffers and their parameters' names, the optimizer
                         state (under ZeRO this rank's shard of it), the RNG states, and the
                         shard's own identity (stage, data-parallel rank, segment indices),
                         checked on load

Between runs of the program no weight version is stashed, so a shard holds the live weights only
(see `backends.checkpoint.state`).

[Note: crash safety] Every file is written to a temporary name in the same directory, flushed,
fsync'ed and renamed into place; the manifest is written the same way and last, after every shard
is on disk. A checkpoint without a manifest, or whose files do not match it, is incomplete and is
never loaded: a crash during a save leaves the previous checkpoint the newest complete one.
Loading reads with `torch.load(weights_only=True)`, so a checkpoint can never run code, and
checks each file's size and sha256 against the manifest before that.

[Note: refuse before changing anything] Loading is two phases: read and check everything, then
apply. The first checks the manifest's fields and types (its step, in a step directory, that
directory's), the program's shape, every file's size and checksum, every field of every shard
against its schema (`backends.checkpoint.schema`), and that each shard fits the engine: identity,
tensors, ZeRO-3 shards, RNG state, optimizer state as it will be loaded
(`backends.checkpoint.restore`); a checkpoint of another shape is first taken by name
(`backends.checkpoint.reshape`). Every refusal is a `CheckpointError` from the first phase,
naming the file and the field, and the second does not fail on what the first accepted, so a
refused checkpoint leaves the engine's parameters, buffers, optimizer state, loss scale, counts
and RNG state bitwise as they were; on the distributed backend every rank checks its own shards
and the ranks agree before any applies (no rank loads unless every rank can).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from schedcc.errors import CheckpointError

__all__ = [
    "MANIFEST",
    "checkpoint_directory",
    "check_meta",
    "check_step",
    "cut_of",
    "complete_checkpoints",
    "is_reshaped",
    "load_stage_states",
    "program_meta",
    "latest_checkpoint",
    "read_checkpoint",
    "read_manifest",
    "read_shard",
    "rewrite_shard",
    "shard_name",
    "step_dir",
    "verify_files",
    "write_manifest",
    "write_shard",
]

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step-(\d+)")


def shard_name(stage: int, dp_rank: int, tp_rank: int | None = None) -> str:
    """The file name of one (stage, data-parallel rank) shard, or with tensor parallelism of one
    (stage, data-parallel rank, tensor-parallel rank) shard."""
    if tp_rank is not None:
        return f"stage{stage}-dp{dp_rank}-tp{tp_rank}.pt"
    return f"stage{stage}-dp{dp_rank}.pt"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint taken after `step` optimizer steps lives under `root`."""
    return Path(root) / f"step-{step:08d}"


def _atomic_write(path: Path, write) -> tuple[int, str]:
    """Write via `write(file)` to a temporary file, fsync it and rename it to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path.stat().st_size, _sha256(path)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_shard(directory: str | os.PathLike, name: str, state: dict[str, Any]) -> dict:
    """Save one shard atomically; returns its manifest entry `{"size", "sha256"}`."""
    import torch

    size, digest = _atomic_write(Path(directory) / name, lambda f: torch.save(state, f))
    return {"size": size, "sha256": digest}


def write_manifest(
    directory: str | os.PathLike, meta: dict[str, Any], step: int, files: dict[str, dict]
) -> Path:
    """Write the manifest last, atomically: the checkpoint is complete once it exists."""
    manifest = {"format": FORMAT_VERSION, "step": step, "meta": meta, "files": files}
    text = json.dumps(manifest, indent=2, sort_keys=True).encode()
    path = Path(directory) / MANIFEST
    _atomic_write(path, lambda f: f.write(text))
    return path


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a checkpoint directory; `CheckpointError` if missing or malformed."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory} is not a complete checkpoint: it has no {MANIFEST}"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable or not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} is not a schedcc checkpoint manifest of format {FORMAT_VERSION}"
        )
    for key in ("step", "meta", "files"):
        if key not in manifest:
            raise CheckpointError(f"{path} lacks the field {key!r}")
    _check_fields(path, manifest)
    return manifest


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _is_count(value: Any) -> bool:
    """A non-negative int (JSON's `true` is not a count)."""
    return type(value) is int and value >= 0


def _check_fields(path: Path, manifest: dict[str, Any]) -> None:
    """Refuse a manifest whose fields have the wrong type, naming the field."""
    if not _is_count(manifest["step"]):
        raise CheckpointError(
            f"{path}: step is {manifest['step']!r}, not a count of optimizer steps"
        )
    if not isinstance(manifest["meta"], dict):
        raise CheckpointError(
            f"{path}: meta is a {type(manifest['meta']).__name__}, not an object of the "
            "program's schedule and shape"
        )
    files = manifest["files"]
    if not isinstance(files, dict):
        raise CheckpointError(
            f"{path}: files is a {type(files).__name__}, not an object of file entries"
        )
    for name, entry in files.items():
        if Path(name).name != name or name.startswith("."):
            raise CheckpointError(f"{path}: {name!r} is not a file name in the checkpoint")
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path}: the entry of {name} is not an object")
        if not _is_count(entry.get("size")):
            raise CheckpointError(
                f"{path}: the entry of {name} has no size in bytes (got {entry.get('size')!r})"
            )
        if not isinstance(entry.get("sha256"), str) or not _SHA256.fullmatch(entry["sha256"]):
            raise CheckpointError(
                f"{path}: the entry of {name} has no sha256 of 64 hex digits "
                f"(got {entry.get('sha256')!r})"
            )


def check_step(directory: str | os.PathLike, step: int) -> None:
    """A checkpoint in a step directory (`step_dir`) holds that many steps: resuming takes the
    data from there (`schedcc run --resume`), so another step would shift it."""
    match = _STEP_DIR.fullmatch(Path(directory).name)
    if match and int(match.group(1)) != step:
        raise CheckpointError(
            f"{Path(directory) / MANIFEST}: step is {step}, but the checkpoint is in "
            f"{Path(directory).name}, the directory of step {int(match.group(1))}: it was "
            "altered or moved"
        )


def rewrite_shard(directory: str | os.PathLike, name: str, state: dict[str, Any]) -> None:
    """Replace the shard `name` of a complete checkpoint with `state`, atomically, and give the
    manifest its new size and sha256 (for tools that edit a checkpoint; a load checks the new
    contents as it checks any shard's).

    Raises:
        CheckpointError: the checkpoint is incomplete or has no shard `name`.
    """
    manifest = read_manifest(directory)
    if name not in manifest["files"]:
        raise CheckpointError(f"checkpoint {directory} has no shard {name}")
    manifest["files"][name] = write_shard(directory, name, state)
    write_manifest(directory, manifest["meta"], manifest["step"], manifest["files"])


def verify_files(directory: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Check every file the manifest lists: present, of its size, with its sha256."""
    for name, entry in manifest["files"].items():
        path = Path(directory) / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory}: file {name} is missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"checkpoint {directory}: file {name} has {size} bytes, the manifest says "
                f"{entry['size']} (truncated or replaced)"
            )
        if _sha256(path) != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint {directory}: file {name} does not match its sha256 in the manifest "
                "(altered or corrupted)"
            )


def read_shard(directory: str | os.PathLike, name: str, manifest: dict[str, Any]) -> dict:
    """Load one verified shard with `torch.load(weights_only=True)`."""
    import pickle

    import torch

    if name not in manifest["files"]:
        raise CheckpointError(f"checkpoint {directory} has no shard {name}")
    try:
        state = torch.load(Path(directory) / name, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {directory}: {name} cannot be loaded safely (weights_only): {first}"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(
            f"checkpoint {directory}: {name} holds a {type(state).__name__}, not a shard's state"
        )
    return state


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The step directories under `root` that hold a manifest, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


def check_meta(
    saved: dict[str, Any], current: dict[str, Any], *, elastic=("data_parallel", "zero", "cut")
) -> None:
    """Refuse a checkpoint whose shape differs from the program's, naming every difference.

    Keys in `elastic` may differ (the loader re-shards); every other key must be equal.
    """
    differences = [
        f"{key}: checkpoint {saved.get(key)!r}, program {current.get(key)!r}"
        for key in sorted(saved.keys() | current.keys())
        if key not in elastic and saved.get(key) != current.get(key)
    ]
    if differences:
        raise CheckpointError(
            "checkpoint does not match this program (" + "; ".join(differences) + "); resume "
            "with the same schedule and shape, or start a new checkpoint directory"
        )


def program_meta(program, cut: Sequence[str] | None = None) -> dict[str, Any]:
    """What a checkpoint records of the program it was saved from (compared on load), and with
    `cut` (`cut_of`) how the model is cut into segments."""
    schedule = program.schedule
    cls = type(schedule)
    meta = {
        "schedule": cls.name or cls.__qualname__,
        "num_stages": schedule.num_stages,
        "num_microbatches": schedule.num_microbatches,
        "num_chunks": schedule.num_chunks,
        "num_batches": schedule.num_batches,
        "weight_delay": schedule.weight_delay,
        "data_parallel": program.data_parallel,
        "zero": program.zero,
    }
    if cut is not None:
        meta["cut"] = list(cut)
    return meta


def checkpoint_directory(path: str | os.PathLike) -> Path:
    """The checkpoint directory `path` names: itself, or the folder of its manifest (what
    `save` returns), so that `engine.load(engine.save(path))` loads what was saved."""
    path = Path(path)
    return path.parent if path.name == MANIFEST and path.is_file() else path


def cut_of(keys: Mapping[int, Sequence[str]], stage_of: Sequence[int]) -> list[dict[str, Any]]:
    """Per segment `k` in order, the stage that holds it and its state dict's keys `keys[k]`:
    the manifest's record of where the model was cut, so that a load at the same p and v but
    another cut takes the parameters by name, and a rank loading by name reads only the files
    of the stages that hold its parameters."""
    return [{"stage": stage_of[k], "keys": list(keys[k])} for k in sorted(keys)]


def read_checkpoint(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete checkpoint whose files are all as it lists them, its step and
    layout checked; no shard is read.

    Raises:
        CheckpointError: incomplete, altered, or its manifest malformed.
    """
    directory = checkpoint_directory(directory)
    manifest = read_manifest(directory)
    check_step(directory, manifest["step"])
    meta = manifest["meta"]
    for key, least in (("data_parallel", 1), ("zero", 0)):
        if not _is_count(meta.get(key)) or meta[key] < least:
            raise CheckpointError(
                f"checkpoint {directory}: meta {key} is {meta.get(key)!r}, not an integer "
                f">= {least}"
            )
    verify_files(directory, manifest)
    return manifest


def is_reshaped(meta: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether a checkpoint of `meta` loads by name into a program of `current` (its
    `program_meta` with the cut): the shape or the cut differs in more than the data-parallel
    degree and ZeRO, which the shards re-shard across as they are ([Note: re-shaping by name]
    in `backends.checkpoint.reshape`)."""
    keys = (meta.keys() | current.keys()) - {"data_parallel", "zero"}
    return any(meta.get(key) != current.get(key) for key in keys)


def load_stage_states(
    directory: str | os.PathLike,
    program,
    stages,
    *,
    tp_rank: int | None = None,
    manifest: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[int, list[dict[str, Any]]]]:
    """Check a checkpoint against `program` and read every shard of `stages`, nothing applied.

    `directory` is the checkpoint's directory or its manifest file (`checkpoint_directory`).

    Returns `(manifest, states)` with `states[stage]` the saved states of every data-parallel
    rank of that stage, in rank order (the program's layout may differ: see
    `backends.checkpoint.state`); with `tp_rank`, those of that tensor-parallel rank. Pass the
    `manifest` `read_checkpoint` returned not to read and verify it again.

    Raises:
        CheckpointError: incomplete, altered, unsafe, or saved from another program.
    """
    directory = checkpoint_directory(directory)
    if manifest is None:
        manifest = read_checkpoint(directory)
    check_meta(manifest["meta"], program_meta(program))
    old_dp = manifest["meta"]["data_parallel"]
    states = {
        s: [read_shard(directory, shard_name(s, r, tp_rank), manifest) for r in range(old_dp)]
        for s in stages
    }
    return manifest, states
