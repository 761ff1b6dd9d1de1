"""The parts `StageRuntime` hands its concerns to, each alone: the graphs a stage holds, the
batch count's division, the loss call's typed failure, a forward's saved-bytes signature, the
ZeRO-3 release and unshard of every chunk, and the checkpoint state of a stage."""

from __future__ import annotations

import pytest
import torch

import schedcc
from schedcc.backends.checkpoint.state import stage_state
from schedcc.backends.runtime.collectives import SoloCollectives
from schedcc.backends.runtime.graphs import Graph, Graphs
from schedcc.backends.runtime.losses import LossBook, StageCounts, call_loss
from schedcc.backends.runtime.memory import signature
from schedcc.backends.runtime.recompute import KeptInput, RngState
from schedcc.backends.runtime.zero import Reducer
from schedcc.errors import RuntimeInstructionError, ScheduleConfigError
from schedcc.ir import BackwardWeight, Recompute


def test_graphs_count_the_bytes_they_hold_and_keep_the_peak():
    """A kept input counts its bytes until the graph rebuilt from it replaces them; a freed
    graph's bytes go; the peak is the most ever held, across a reset."""
    graphs = Graphs(stage=1)
    value = torch.zeros(4, dtype=torch.float64)  # 32 bytes
    kept = KeptInput(value, [], {}, RngState([]))
    graphs.keep(0, 0, kept)
    graphs.hold(1, 0, Graph([], [], [], 100))
    assert graphs.num_bytes == 132
    assert graphs.take_kept(Recompute(0, 0)) is kept
    graphs.hold(0, 0, Graph([], [], [], 50), replacing=kept)
    assert graphs.num_bytes == 150
    graphs.free(BackwardWeight(1, 0))
    assert (graphs.num_bytes, graphs.peak) == (50, 150)
    graphs.reset()
    assert (graphs.num_bytes, graphs.peak) == (0, 150)


def test_graphs_refuse_a_missing_graph_or_kept_input_naming_stage_and_instruction():
    """A backward without its forward's graph, or a recompute without a kept input, is a
    `RuntimeInstructionError` naming the stage and the instruction."""
    graphs = Graphs(stage=2)
    with pytest.raises(RuntimeInstructionError, match=r"stage 2: B3 has no forward graph"):
        graphs.graph(schedcc.ir.Backward(3, 0))
    with pytest.raises(RuntimeInstructionError, match=r"stage 2: R3 has no kept input"):
        graphs.take_kept(Recompute(3, 0))


def _counts(grad: torch.Tensor) -> tuple[StageCounts, torch.nn.Parameter]:
    program = schedcc.compile(schedcc.get_schedule("1f1b")(1, 2))
    layout = program.tensors.layout
    book = LossBook.of(layout, 2, 1)
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = grad.clone()
    counts = StageCounts(book, program, layout, [0], [param], SoloCollectives())
    for i in range(2):  # two microbatches of batch 0, summing 3 and 5 items
        book.objective(0, (torch.tensor(1.0), i * 2 + 3), where="test")
    return counts, param


def test_a_batch_count_divides_once_whether_or_not_its_norm_ran():
    """The step divides the batch's gradients by its count, summed over its microbatches,
    unless its GradNorm already did: once either way."""
    counts, param = _counts(torch.full((3,), 16.0))
    counts.divide_for_step(0)
    assert torch.equal(param.grad, torch.full((3,), 2.0))
    counts, param = _counts(torch.full((3,), 16.0))
    counts.divide_for_norm(0)
    counts.divide_for_step(0)
    assert torch.equal(param.grad, torch.full((3,), 2.0))


def test_a_failing_loss_fn_is_the_users_error_naming_both_shapes():
    """`loss_fn` raising on mismatched shapes is a `ScheduleConfigError` naming both."""
    with pytest.raises(ScheduleConfigError, match=r"output of shape \(4, 3\), target of shape"):
        call_loss(lambda out, target: (out - target).sum(), torch.ones(4, 3), torch.ones(5, 2))


def test_a_signature_changes_with_shape_target_training_and_grad_mode_only():
    """Forwards alike in chunk, input layout, target layout, training flag and grad mode share a
    signature; a change in any of them gives another."""
    x, t = torch.ones(2, 3), torch.ones(2)
    same = signature(0, torch.zeros(2, 3), torch.zeros(2), training=True)
    assert signature(0, x, t, training=True) == same
    assert signature(1, x, t, training=True) != same
    assert signature(0, torch.ones(4, 3), t, training=True) != same
    assert signature(0, x, None, training=True) != same
    assert signature(0, x, t, training=False) != same
    with torch.no_grad():
        assert signature(0, x, t, training=True) != same


def test_release_all_and_unshard_all_round_trip_every_chunk():
    """ZeRO-3 between runs: every chunk's parameters released to nothing, then whole again with
    their values, the shards unchanged."""
    modules = [torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)]
    before = [[p.detach().clone() for p in m.parameters()] for m in modules]
    reducer = Reducer(modules, SoloCollectives(), zero=True, release=True)
    assert all(p.numel() == 0 for m in modules for p in m.parameters())
    reducer.unshard_all()
    after = [[p.detach().clone() for p in m.parameters()] for m in modules]
    assert all(torch.equal(a, b) for pa, pb in zip(before, after) for a, b in zip(pa, pb))
    reducer.release_all()
    assert all(p.numel() == 0 for m in modules for p in m.parameters())


def test_a_zero3_stage_state_records_its_shards_with_names_and_shapes():
    """Under ZeRO-3 a stage's state records each chunk's flat shard and each parameter's name
    and shape (what `whole_states` rebuilds from); otherwise neither."""
    modules = [torch.nn.Linear(3, 2)]
    reducer = Reducer(modules, SoloCollectives(), zero=True, release=True)
    fields = {"segments": [0], "rank": 0, "size": 1, "skipped_steps": 0, "loss_scale": None}
    state = stage_state(modules, None, reducer, stage=0, zero=3, **fields)
    assert state["shapes"] == [[("weight", [2, 3]), ("bias", [2])]]
    assert state["numels"] == [[6, 2]]
    assert [s.numel() for s in state["shards"]] == [8]
    plain = stage_state(modules, None, reducer, stage=0, zero=1, **fields)
    assert "shards" not in plain
    assert "shapes" not in plain
