"""StageRuntime: the instruction table, split backward, and measured activation memory."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import batches, make_segments, mse, sgd

import schedcc
from schedcc import Backward, BackwardInput, BackwardWeight, Forward, Schedule
from schedcc.backends.local import Engine
from schedcc.backends.runtime.stage import StageRuntime
from schedcc.errors import RuntimeInstructionError, ScheduleConfigError


class SplitGPipe(Schedule):
    """GPipe with the backward split: every I in reverse, then the W's in `w_order`."""

    name = "test-split-gpipe"

    def __init__(self, *args, w_order: str = "forward", **kwargs) -> None:
        self.w_order = w_order
        super().__init__(*args, **kwargs)

    def order(self, stage: int):
        for b in range(self.num_batches):
            mbs = self.microbatches(b)
            yield from (Forward(i) for i in mbs)
            if self.w_order == "eager":
                for i in reversed(mbs):
                    yield BackwardInput(i)
                    yield BackwardWeight(i)
                continue
            yield from (BackwardInput(i) for i in reversed(mbs))
            ws = mbs if self.w_order == "forward" else reversed(mbs)
            yield from (BackwardWeight(i) for i in ws)


def _runtime(program, stage=0, modules=None, **kwargs) -> StageRuntime:
    modules = modules if modules is not None else make_segments(program.schedule.num_chunks)
    return StageRuntime(program, stage, modules, mse, sgd, **kwargs)


def _flat(segments) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for s in segments for p in s.parameters()])


@pytest.fixture
def program():
    return schedcc.compile(schedcc.get_schedule("1f1b")(2, 2))


def test_an_unknown_instruction_names_the_runtime_and_the_instruction(program):
    """run() of a comm instruction raises an error naming StageRuntime and the instruction."""
    with pytest.raises(RuntimeInstructionError, match=r"StageRuntime \(stage 0\) cannot run SA0"):
        _runtime(program).run(schedcc.SendActivation(0))


def test_a_foreign_object_is_refused(program):
    """run() of something that is not an instruction names its type."""
    with pytest.raises(RuntimeInstructionError, match="str"):
        _runtime(program).run("F0")  # type: ignore[arg-type]


def test_one_module_per_chunk_is_required(program):
    """A stage with one chunk refuses two modules."""
    with pytest.raises(ScheduleConfigError, match="1 chunk"):
        _runtime(program, modules=make_segments(2))


def test_collectives_must_span_the_data_parallel_ranks(program):
    """A dp=2 program refuses the single-replica default collectives."""
    two = schedcc.compile(schedcc.get_schedule("1f1b")(2, 2), data_parallel=2)
    with pytest.raises(ScheduleConfigError, match="data_parallel=2"):
        _runtime(two)


def test_sending_before_the_compute_is_an_error(program):
    """outgoing() for an activation not yet computed says so."""
    with pytest.raises(RuntimeInstructionError, match="nothing to send"):
        _runtime(program).outgoing(schedcc.SendActivation(0))


def test_a_compute_whose_input_never_arrived_names_the_tensor(program):
    """A forward on stage 1 with no RecvActivation first names the missing tensor by its key."""
    rt = _runtime(program, stage=1)
    rt.load_batch(0, None, list(batches(1, 2)[0][1].chunk(2)))
    missing = "activation of microbatch 0 out of segment 0"
    with pytest.raises(RuntimeInstructionError, match=missing):
        rt.run(Forward(0))


def test_a_receive_from_no_peer_is_refused(program):
    """incoming() on stage 0 of a RecvActivation (segment 0 has no producer) is refused."""
    with pytest.raises(RuntimeInstructionError, match="from another stage"):
        _runtime(program).incoming(schedcc.RecvActivation(0), batches(1, 1)[0][0])


def test_received_activations_produce_an_input_gradient(program):
    """A received activation is a grad-requiring leaf whose gradient the backward sends."""
    rt = _runtime(program, stage=1)
    x, y = batches(1, 2)[0]
    rt.load_batch(0, None, list(y.chunk(2)))
    sent = x[:1].clone()
    rt.incoming(schedcc.RecvActivation(0), sent)
    rt.run(Forward(0))
    rt.run(Backward(0))
    ((grad,),) = rt.outgoing(schedcc.SendGrad(0)).value()  # the message (grads,)
    assert grad.shape == sent.shape
    assert grad.abs().sum() > 0
    assert not sent.requires_grad  # the caller's tensor is not touched


@pytest.mark.parametrize("w_order", ["forward", "reverse", "eager"])
@pytest.mark.parametrize(("p", "m"), [(2, 3), (3, 2)])
def test_split_backward_equals_full_backward(p, m, w_order):
    """BackwardInput then BackwardWeight, in any valid order, trains exactly like Backward."""
    split = schedcc.compile(SplitGPipe(p, m, num_batches=2, w_order=w_order))
    full = schedcc.compile(schedcc.get_schedule("gpipe")(p, m, num_batches=2))
    a = make_segments(p)
    b = copy.deepcopy(a)
    data = batches(2, 2 * m)
    la = list(Engine(split, a, mse, sgd).train(data))
    lb = list(Engine(full, b, mse, sgd).train(data))
    assert la == pytest.approx(lb, abs=1e-12)
    torch.testing.assert_close(_flat(a), _flat(b), atol=1e-12, rtol=0)


def _peaks(name: str, p: int, m: int) -> tuple[list[int], tuple[int, ...]]:
    program = schedcc.compile(schedcc.get_schedule(name)(p, m))
    engine = Engine(program, make_segments(p), mse, sgd)
    list(engine.train(batches(1, m)))
    return engine.peak_activation_bytes, schedcc.simulate(program).peak_activations


def test_measured_activation_peaks_follow_the_simulator():
    """Peak activation bytes per stage are the simulated peak count times one microbatch's bytes."""
    gpipe_bytes, gpipe_count = _peaks("gpipe", 3, 9)
    ofob_bytes, ofob_count = _peaks("1f1b", 3, 9)
    assert ofob_count[0] < gpipe_count[0]
    for s in range(3):
        assert gpipe_bytes[s] * ofob_count[s] == ofob_bytes[s] * gpipe_count[s]
    assert sum(ofob_bytes) < sum(gpipe_bytes)


_BUILTINS = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved-1f1b", 2),
    ("2bw", 1),
    ("zb-h1", 1),
    ("zb-h2", 1),
    ("zb-v", 2),
    ("looped-bfs", 2),
    ("interleaved-zb", 2),
    ("dualpipe-v", 2),
    ("v-half", 2),
    ("v-min", 2),
]


@pytest.mark.parametrize(("name", "v"), _BUILTINS)
def test_measured_activation_bytes_stay_within_the_simulated_peak(name, v):
    """Every built-in's measured peak bytes per stage are at most its simulated peak count times
    what one microbatch holds on that stage (gpipe at m = 1 measures it: every chunk's)."""
    p, m = 3, 6
    one = schedcc.compile(schedcc.get_schedule("gpipe")(p, 1, v))
    per_microbatch = Engine(one, make_segments(p * v), mse, sgd)
    list(per_microbatch.train(batches(1, 1)))
    program = schedcc.compile(schedcc.get_schedule(name)(p, m, v))
    engine = Engine(program, make_segments(p * v), mse, sgd)
    list(engine.train(batches(program.schedule.num_batches, m)))
    peaks = schedcc.simulate(program).peak_activations
    for s in range(p):
        assert engine.peak_activation_bytes[s] > 0, (name, s)
        bound = peaks[s] * per_microbatch.peak_activation_bytes[s]
        assert engine.peak_activation_bytes[s] <= bound, (name, s, peaks)


def test_activation_bytes_return_to_zero_after_a_step():
    """Every saved activation is released by the end of the program."""
    program = schedcc.compile(SplitGPipe(2, 2, w_order="reverse"))
    engine = Engine(program, make_segments(2), mse, sgd)
    list(engine.train(batches(1, 4)))
    assert [rt.activation_bytes for rt in engine.runtimes[0]] == [0, 0]
    assert all(peak > 0 for peak in engine.peak_activation_bytes)


def test_the_loss_is_recorded_on_the_last_stage(program):
    """losses[batch] is the mean of the microbatch losses, on the last segment's stage only."""
    engine = Engine(program, make_segments(2), mse, sgd)
    (loss,) = engine.train(batches(1, 4))
    assert engine.runtimes[0][1].book.losses() == {0: pytest.approx(loss)}
    assert engine.runtimes[0][0].book.losses() == {}


def test_activation_bytes_are_measured_once_not_once_per_run(monkeypatch):
    """[Note: activation bytes are measured once]: the saved-tensor hooks run on the first
    forward of each signature, and a later run of the program reuses its count."""
    program = schedcc.compile(schedcc.get_schedule("1f1b")(2, 4))
    engine = Engine(program, make_segments(2), mse, sgd)
    hooked = []
    real = torch.autograd.graph.saved_tensors_hooks

    def counting(pack, unpack):
        hooked.append(1)
        return real(pack, unpack)

    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", counting)
    list(engine.train(batches(1, 4)))
    first = len(hooked)
    peaks = list(engine.peak_activation_bytes)
    list(engine.train(batches(2, 4)))
    assert first == 2  # one signature per stage
    assert len(hooked) == first
    assert list(engine.peak_activation_bytes) == peaks
