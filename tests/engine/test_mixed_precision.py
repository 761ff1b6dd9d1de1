"""Mixed precision: low-precision compute and boundary tensors, float32 master weights and
optimizer state, float16's dynamic loss scale skipping the steps that overflow."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import batches, make_segments, mse

import schedcc
from schedcc.backends.local import Engine
from schedcc.errors import ScheduleConfigError


def _float32_model(num_segments: int):
    return [segment.float() for segment in make_segments(num_segments, width=16)]


def _data(num_batches: int = 5):
    return [(x.float(), y.float()) for x, y in batches(num_batches, 16, width=16)]


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _train(program, segments, dtype):
    """Train on five batches; the losses and the bytes the stages sent (float tensors)."""
    engine = Engine(program, segments, mse, _adam, mixed_precision=dtype)
    sent = [0]
    for runtimes in engine.runtimes:
        for rt in runtimes:
            outgoing = rt.outgoing

            def counted(op, outgoing=outgoing):
                message = outgoing(op)
                sent[0] += sum(t.numel() * t.element_size() for t in message.tensors)
                return message

            rt.outgoing = counted
    return engine, list(engine.train(_data())), sent[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_trains_close_to_float32_with_float32_master_weights(dtype):
    """1f1b p=2: losses within a few percent of float32 training over 5 steps, parameters and
    Adam's state stay float32, and the stages send half the bytes."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4), grad_norm=True)
    segments = _float32_model(2)
    _, full, full_bytes = _train(program, copy.deepcopy(segments), None)
    engine, low, low_bytes = _train(program, segments, dtype)
    assert low == pytest.approx(full, rel=0.03)
    assert low_bytes * 2 == full_bytes
    for rt in engine.runtimes[0]:
        assert all(p.dtype == torch.float32 for m in rt.modules for p in m.parameters())
        for state in rt.optimizer.state.values():
            assert state["exp_avg"].dtype == torch.float32
    assert engine.skipped_steps == 0
    assert (engine.loss_scale is None) == (dtype == torch.bfloat16)


def test_float16_overflow_skips_the_step_and_halves_the_scale(tmp_path):
    """A loss scale so large that the float16 gradients overflow: the step is skipped on every
    stage (weights unchanged), the scale halves (a checkpoint keeps it and the skipped count),
    and the next step trains."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4), grad_norm=True)
    segments = _float32_model(2)
    engine = Engine(program, segments, mse, _adam, mixed_precision=torch.float16)
    for rt in engine.runtimes[0]:
        rt.norm.scaler.scale = 2.0**100
    before = [p.detach().clone() for s in segments for p in s.parameters()]
    data = _data(2)
    list(engine.train(data[:1]))
    assert engine.skipped_steps == 1
    assert engine.loss_scale == 2.0**99
    engine.save(tmp_path)
    restored = Engine(program, _float32_model(2), mse, _adam, mixed_precision=torch.float16)
    restored.load(tmp_path)
    assert (restored.loss_scale, restored.skipped_steps) == (2.0**99, 1)
    assert all(
        torch.equal(a, p) for a, p in zip(before, (p for s in segments for p in s.parameters()))
    )
    for rt in engine.runtimes[0]:
        rt.norm.scaler.scale = 2.0**8
    list(engine.train(data[1:]))
    assert engine.skipped_steps == 1
    assert not all(
        torch.equal(a, p) for a, p in zip(before, (p for s in segments for p in s.parameters()))
    )


def test_float16_needs_the_norm_and_a_known_dtype():
    """float16 without GradNorm, or a dtype that is not a low precision, names the fix."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    with pytest.raises(ScheduleConfigError, match="grad_norm=True"):
        Engine(program, _float32_model(2), mse, _adam, mixed_precision=torch.float16)
    with pytest.raises(ScheduleConfigError, match="mixed_precision must be"):
        Engine(program, _float32_model(2), mse, _adam, mixed_precision=torch.int8)
