"""A damaged checkpoint is refused whole: every field of every shard is checked before anything
is loaded (local backend).

A hostile edit rewrites a shard and gives the manifest its new checksum
(`files.rewrite_shard`), so only the checks of the contents stand between it and the engine.
Each test loads a damaged checkpoint into an engine that has trained (it has optimizer state, a
loss scale, a step count) and checks: `CheckpointError` naming the file and the field, and
every parameter, buffer, ZeRO shard, optimizer state tensor and setting, loss scale, skipped
step count, step count and the RNG state bitwise as they were.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import schedcc
from schedcc.backends.checkpoint import files as ckpt
from schedcc.backends.local import Engine
from schedcc.errors import CheckpointError

WIDTH = 6


class _Scaled(torch.nn.Module):
    """tanh(Linear(x)) times a buffer: a layer with a buffer beside its parameters."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH, dtype=dtype)
        self.register_buffer("scale", 0.5 + torch.rand(WIDTH, dtype=dtype))  # by the seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * self.scale


def _engine(*, seed=0, dp=1, zero=0, float16=False, schedule="1f1b", m=2):
    """2 stages of one `_Scaled` each; float16: float32 weights under float16's loss scale."""
    torch.manual_seed(seed)
    dtype = torch.float32 if float16 else torch.float64
    model = torch.nn.Sequential(_Scaled(dtype), _Scaled(dtype))
    segments = schedcc.partition(model, 2, method="uniform")
    program = schedcc.compile(
        schedcc.get_schedule(schedule)(2, m), data_parallel=dp, zero=zero, grad_norm=float16
    )
    return Engine(
        program,
        segments,
        torch.nn.functional.mse_loss,
        lambda params: torch.optim.Adam(params, lr=0.01),
        mixed_precision=torch.float16 if float16 else None,
    )


def _data(n, *, seed, float16=False):
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if float16 else torch.float64
    return [
        tuple(torch.randn(4, WIDTH, generator=gen, dtype=dtype) for _ in range(2)) for _ in range(n)
    ]


def _trained(*, seed, **kwargs) -> Engine:
    engine = _engine(seed=seed, **kwargs)
    list(engine.train(_data(1, seed=seed, float16=kwargs.get("float16", False))))
    return engine


def _saved(root: Path, **kwargs) -> Path:
    """A real checkpoint, in its step directory, of an engine trained one batch."""
    engine = _trained(seed=0, **kwargs)
    directory = ckpt.step_dir(root, engine.steps)
    engine.save(directory)
    return directory


def _snapshot(engine: Engine) -> list[Any]:
    """Everything a load may change, cloned: per runtime its modules' tensors, ZeRO shards,
    optimizer state and settings, loss scale and skipped steps; the step count; the RNG."""
    kept: list[Any] = [engine.steps, torch.get_rng_state()]
    for runtimes in engine.runtimes:
        for rt in runtimes:
            scaler = rt.norm.scaler
            kept += [
                [mod.state_dict() for mod in rt.modules],
                rt.state.shards,
                rt.optimizer.state_dict() if rt.optimizer is not None else None,
                scaler.state_dict() if scaler is not None else None,
                rt.state.skipped_steps,
            ]
    return _clone(kept)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _same(a: Any, b: Any) -> bool:
    """Bitwise equal (tensors by dtype and bits; NaN equals NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def _read(directory: Path, name: str) -> dict[str, Any]:
    return torch.load(directory / name, weights_only=True)


def _edit(directory: Path, name: str, edit: Callable[[dict], Any]) -> None:
    """Edit one shard as a hostile user can: rewrite it and its manifest entry."""
    state = _read(directory, name)
    edit(state)
    ckpt.rewrite_shard(directory, name, state)


def _assert_refused(engine: Engine, directory: Path, *words: str) -> str:
    """Loading `directory` raises `CheckpointError` whose message holds each of `words`, and
    changes nothing; returns the message."""
    before = _snapshot(engine)
    with pytest.raises(CheckpointError) as caught:
        engine.load(directory)
    message = str(caught.value)
    for word in words:
        assert word in message, message
    assert _same(before, _snapshot(engine)), f"the refused load changed the engine: {message}"
    return message


STAGE0, STAGE1 = ckpt.shard_name(0, 0), ckpt.shard_name(1, 0)


# -- the cases an audit found --------------------------------------------------------------------


def test_loss_scale_that_is_not_a_number_is_refused_before_anything_changes(tmp_path):
    """fp16: stage 1's loss scale "abc" is refused up front; stage 0's weights, optimizer
    state and loss scale are not replaced first (a half-applied load)."""
    directory = _saved(tmp_path, float16=True)
    _edit(directory, STAGE1, lambda s: s["loss_scale"].update(scale="abc"))
    engine = _trained(seed=7, float16=True)
    _assert_refused(engine, directory, STAGE1, "loss_scale['scale'] is 'abc'")


@pytest.mark.parametrize("scale", [-1.0, 0.0, math.nan, math.inf, True])
def test_loss_scale_that_is_not_positive_and_finite_is_refused(tmp_path, scale):
    """A loss scale of -1, 0, NaN, inf or a bool is refused, not loaded silently."""
    directory = _saved(tmp_path, float16=True)
    _edit(directory, STAGE0, lambda s: s["loss_scale"].update(scale=scale))
    engine = _trained(seed=7, float16=True)
    _assert_refused(engine, directory, STAGE0, "loss_scale['scale']", "positive finite")


@pytest.mark.parametrize("skipped", ["abc", -1, 2.5, None, True])
def test_skipped_steps_that_is_not_a_count_is_refused(tmp_path, skipped):
    """skipped_steps "abc" (which made the next step raise TypeError), -1, 2.5, None or a
    bool is refused."""
    directory = _saved(tmp_path)
    _edit(directory, STAGE1, lambda s: s.update(skipped_steps=skipped))
    engine = _trained(seed=7)
    _assert_refused(engine, directory, STAGE1, "skipped_steps is", "an integer >= 0")


def _zero3_edits() -> dict[str, Callable[[dict], Any]]:
    def shorter_shard(s):
        s["shards"][0] = s["shards"][0][:-1]

    def shard_of_another_dtype(s):
        s["shards"][0] = s["shards"][0].float()

    def every_tensor_of_another_dtype(s):  # consistent in itself, not with rank 0's
        s["shards"][0] = s["shards"][0].float()
        s["modules"][0] = {k: v.float() for k, v in s["modules"][0].items()}

    def rename(s):
        s["shapes"][0][0] = ("nonexistent", s["shapes"][0][0][1])

    def reshape(s):
        s["shapes"][0][0] = (s["shapes"][0][0][0], [WIDTH, WIDTH + 1])

    return {
        "shards": lambda s: s.update(shards=s["shards"][0]),
        "shards[0]": shorter_shard,
        "shards[0] dtype": shard_of_another_dtype,
        "shards[0] dtypes": every_tensor_of_another_dtype,
        "shards dropped": lambda s: s.update(shards=[]),
        "shapes": lambda s: s.update(shapes=None),
        "shapes[0]": lambda s: s["shapes"].__setitem__(0, "abc"),
        "shapes[0] name": rename,
        "shapes[0] shape": reshape,
        "shapes[0][0][1]": lambda s: s["shapes"][0][0][1].__setitem__(0, -1),
        "numels": lambda s: s["numels"][0].__setitem__(0, WIDTH),
        "missing": lambda s: s.pop("shapes"),
    }


@pytest.mark.parametrize(("field", "edit"), list(_zero3_edits().items()))
def test_edited_zero3_shard_fields_are_refused(tmp_path, field, edit):
    """Each edited ZeRO-3 field (the flat shards, the names and shapes, the sizes) is a
    `CheckpointError` naming the file, not an IndexError, AttributeError or TypeError."""
    directory = _saved(tmp_path, dp=2, zero=3)
    name = ckpt.shard_name(1, 1)
    _edit(directory, name, edit)
    engine = _trained(seed=7, dp=2, zero=3)
    _assert_refused(engine, directory, name, field.split(" ")[0].split("[")[0])


def test_optimizer_numbering_is_checked_where_the_state_is_re_sharded(tmp_path):
    """A dp=2 ZeRO-1 checkpoint loaded at dp=1 (re-sharded by parameter number): parameters
    renumbered (the state with them, on every rank) are refused, not loaded as no optimizer
    state."""

    def renumber(state):
        optimizer = state["optimizer"]
        optimizer["param_groups"][0]["params"] = [5]
        optimizer["state"] = {5: optimizer["state"][0]}

    directory = _saved(tmp_path, dp=2, zero=1)
    for rank in range(2):
        _edit(directory, ckpt.shard_name(1, rank), renumber)
    engine = _trained(seed=7)
    _assert_refused(engine, directory, "stage1-dp0.pt", "number the parameters [5]")


def test_ranks_that_disagree_on_a_scalar_state_are_refused_where_it_is_re_sharded(tmp_path):
    """Re-sharding keeps one rank's Adam `step` for all: a rank whose step differs (shards of
    two checkpoints) is refused, not silently overruled."""
    directory = _saved(tmp_path, dp=2, zero=1)
    _edit(directory, ckpt.shard_name(1, 1), lambda s: s["optimizer"]["state"][0]["step"].add_(1))
    engine = _trained(seed=7)
    _assert_refused(engine, directory, "stage 1", "'step'", "cannot be re-sharded")


def test_manifest_step_other_than_its_directory_is_refused(tmp_path):
    """A manifest step of 0 in `step-00000001/` is refused: resuming would take the data from
    the wrong step (and overwrite that step's checkpoint)."""
    directory = _saved(tmp_path)
    path = directory / ckpt.MANIFEST
    manifest = json.loads(path.read_text())
    manifest["step"] = 0
    path.write_text(json.dumps(manifest))
    engine = _trained(seed=7)
    _assert_refused(engine, directory, "step is 0", "step-00000001", "the directory of step 1")
    assert ckpt.latest_checkpoint(tmp_path) == directory  # what `schedcc run --resume` loads


def test_a_step_directory_checkpoint_still_loads(tmp_path):
    """The checks refuse nothing a real save wrote (fp16, and ZeRO-3 over two replicas)."""
    for kwargs in ({"float16": True}, {"dp": 2, "zero": 3}):
        directory = _saved(tmp_path / str(len(kwargs)), **kwargs)
        engine = _trained(seed=7, **kwargs)
        engine.load(directory)
        assert _same(_snapshot(_trained(seed=0, **kwargs)), _snapshot(engine))


# -- every field: a table of edits ---------------------------------------------------------------

_NAN = math.nan

#: Per kind of leaf value, values of another type or out of any field's range.
_BAD_LEAVES: dict[type, list[Any]] = {
    int: ["abc", -1, 2.5, _NAN, None],
    float: ["abc", -1.0, _NAN, math.inf, None],
    bool: ["abc", 2, None],
    type(None): ["abc", 2.5],
    str: [1, None],
}


def _walk(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """Every (path, value) in a shard, containers and leaves alike, outermost first."""
    yield path, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, (*path, key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(item, (*path, i))


def _bad_values(path: tuple, value: Any) -> Iterator[tuple[str, Callable[[Any], Any]]]:
    """(label, make) for each damage of the value at `path` that no field accepts."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return  # a ZeRO-3 placeholder: the shards hold the values (checked there)
        yield "a str", lambda v: "abc"
        yield "a float", lambda v: 1.0
        if value.dim() == 0:
            yield "NaN", lambda v: torch.full_like(v, _NAN)
            yield "negative", lambda v: torch.full_like(v, -1)
        else:
            yield "shorter", lambda v: v.reshape(-1)[:-1]
            other = torch.float32 if value.dtype != torch.float32 else torch.float64
            yield f"as {other}", lambda v: v.to(other)
        return
    if isinstance(value, (dict, list, tuple)):
        yield "a str", lambda v: "abc"
        if value and path[-2:] != ("optimizer", "state"):  # a parameter may have no state yet
            if isinstance(value, dict):
                key = list(value)[-1]
                yield f"without {key!r}", lambda v: {k: x for k, x in v.items() if k != key}
            else:
                yield "one item short", lambda v: type(v)(list(v)[:-1])
        if isinstance(value, dict) and path:
            yield "with an unknown field", lambda v: {**v, "unknown": 1}
        return
    for bad in _BAD_LEAVES[type(value)]:
        if bad == 2.5 and "param_groups" in path:
            continue  # a setting of 0 may be 2.5 (Adam's weight_decay)
        yield repr(bad), lambda v, bad=bad: bad


def _set(state: dict, path: tuple, make: Callable[[Any], Any]) -> None:
    if not path:
        return
    *outer, last = path
    holder = state
    for key in outer:
        holder = holder[key]
    if isinstance(holder, tuple):  # rebuild the tuple in its parent
        _set(
            state,
            tuple(outer),
            lambda t: tuple(make(x) if i == last else x for i, x in enumerate(t)),
        )
        return
    holder[last] = make(holder[last])


def _field_words(path: tuple) -> list[str]:
    """What a refusal must name: the top-level field, or the last named key under it."""
    named = [str(key) for key in path if isinstance(key, str)]
    return [named[0], named[-1]] if named else []


def _normal(text: str) -> str:
    return re.sub(r"[\s\-]", "_", text.lower())


@pytest.mark.parametrize(
    ("kwargs", "loaded"),
    [
        ({"float16": True}, {"float16": True}),
        ({"dp": 2, "zero": 3}, {"dp": 2, "zero": 3}),
        ({"dp": 2, "zero": 1}, {}),
        ({"dp": 2, "zero": 3}, {"schedule": "gpipe", "m": 4}),
        ({"dp": 2, "zero": 1, "float16": True}, {"schedule": "gpipe", "m": 4, "float16": True}),
    ],
    ids=[
        "float16",
        "zero3-dp2",
        "zero1-dp2-resharded",
        "zero3-dp2-by-name",
        "zero1-dp2-float16-by-name",
    ],
)
def test_every_edited_field_of_a_shard_is_refused_and_nothing_changes(tmp_path, kwargs, loaded):
    """Each field of a real shard (stage 1, the last data-parallel rank), at every depth,
    given a value of another type, negative, NaN, inf, of another shape or dtype, a key or
    item short, or an unknown field: `CheckpointError` naming the file and the field, and the
    engine (of the same layout, or of another: re-sharded, or of another schedule and m: taken
    by name) bitwise unchanged."""
    directory = _saved(tmp_path, **kwargs)
    name = ckpt.shard_name(1, kwargs.get("dp", 1) - 1)
    original = _read(directory, name)
    pristine = {p.name: p.read_bytes() for p in directory.iterdir()}
    engine = _trained(seed=7, **loaded)
    before = _snapshot(engine)
    failures, tried = [], 0
    for path, value in list(_walk(original))[1:]:
        for label, make in _bad_values(path, value):
            tried += 1
            state = _read(directory, name)
            _set(state, path, make)
            ckpt.rewrite_shard(directory, name, state)
            try:
                engine.load(directory)
            except CheckpointError as exc:
                message = _normal(str(exc))
                words = [_normal(w) for w in [name, *_field_words(path)]]
                if name not in str(exc) or not any(w in message for w in words[1:] or [""]):
                    failures.append(f"{path} {label}: the refusal names neither: {exc}")
            except Exception as exc:  # what the test looks for
                failures.append(f"{path} {label}: {type(exc).__name__}: {exc}")
            else:
                failures.append(f"{path} {label}: loaded")
            if not _same(before, _snapshot(engine)):
                pytest.fail(f"{path} {label}: the engine changed; so far: {failures}")
            for file_name, data in pristine.items():
                (directory / file_name).write_bytes(data)
    assert tried > 100
    assert failures == [], "\n".join(failures)


# -- on every rank -------------------------------------------------------------------------------

# Each rank (stage) trains a step under float16 and saves; rank 0 edits stage 1's loss scale to
# "abc" (the manifest's checksum rewritten). Every rank tries the load: refused on both (rank 0's
# own shard is fine), and neither changed its weights, optimizer, loss scale, counts or RNG.
_WORKER = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    from pathlib import Path
    import torch
    import torch.distributed as dist
    import schedcc
    from schedcc.backends.checkpoint import files as ckpt
    from schedcc.backends.distributed.engine import Engine
    from schedcc.backends.run.launch import spawn
    from schedcc.errors import CheckpointError

    ROOT = Path(sys.argv[1])

    def snapshot(engine):
        rt = engine.runtime
        return [
            [t.detach().clone() for m in engine.modules for t in m.state_dict().values()],
            rt.optimizer.state_dict(),
            rt.norm.scaler.state_dict(),
            rt.state.skipped_steps,
            engine.steps,
            torch.get_rng_state(),
        ]

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return type(a) is type(b) and a == b

    def worker(rank, world):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        torch.manual_seed(0)
        segments = [torch.nn.Linear(6, 6) for _ in range(2)]
        program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2), grad_norm=True)
        engine = Engine(
            program,
            segments,
            torch.nn.functional.mse_loss,
            lambda params: torch.optim.Adam(params, lr=0.01),
            mixed_precision=torch.float16,
            timeout=60,
        )
        gen = torch.Generator().manual_seed(1)
        x, y = (torch.randn(4, 6, generator=gen) for _ in range(2))
        engine.train_step(x, y)
        directory = ckpt.step_dir(ROOT, engine.steps)
        engine.save(directory)
        if rank == 0:
            name = ckpt.shard_name(1, 0)
            state = torch.load(directory / name, weights_only=True)
            state["loss_scale"]["scale"] = "abc"
            ckpt.rewrite_shard(directory, name, state)
        engine.train_step(x, y)  # other weights, state and counts than the checkpoint's
        dist.barrier()
        kept = snapshot(engine)
        try:
            engine.load(directory)
        except CheckpointError as exc:
            print(f"rank {rank} refused: {exc}", flush=True)
        except Exception as exc:
            print(f"rank {rank} failed: {type(exc).__name__}: {exc}", flush=True)
        else:
            print(f"rank {rank} loaded the damaged checkpoint", flush=True)
        print(f"rank {rank} unchanged: {same(kept, snapshot(engine))}", flush=True)
        if rank == 1:  # a check that fails otherwise than by refusing: rank 0 must not wait
            engine.runtime.state.check_state = lambda saved: 1 / 0
        try:
            engine.load(ROOT / "step-00000001")
        except Exception as exc:
            print(f"rank {rank} then: {type(exc).__name__}: {exc}", flush=True)
        print(f"rank {rank} still unchanged: {same(kept, snapshot(engine))}", flush=True)
        return 0

    if __name__ == "__main__":
        sys.exit(spawn(worker, 2, grace=30.0))
    """
)


def test_a_damaged_shard_is_refused_on_every_rank_and_no_rank_changes(tmp_path):
    """2 gloo ranks, float16: stage 1's loss scale "abc" (it used to fail on rank 1 after
    its weights were replaced) is a `CheckpointError` naming rank 1, the file and the field on
    both ranks, and neither rank changes anything; a check that fails by an error of another
    kind on rank 1 raises it there and a `CheckpointError` naming it on rank 0 (no wait)."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the ranks too, whatever happened
    assert proc.returncode == 0, err
    for rank in (0, 1):
        assert (
            f"rank {rank} refused: rank 1 (stage 1): stage1-dp0.pt: loss_scale['scale'] is "
            "'abc', not a positive finite number"
        ) in out, out
        assert f"rank {rank} unchanged: True" in out, out
        assert f"rank {rank} still unchanged: True" in out, out
    assert "rank 1 then: ZeroDivisionError: division by zero" in out, out
    assert (
        "rank 0 then: CheckpointError: rank 1 (stage 1) failed: division by zero checking the "
        "checkpoint"
    ) in out, out
