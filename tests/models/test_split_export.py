"""schedcc.split over torch.export: glue code fx cannot trace, ties by identity and by name,
free batch and sequence dimensions, the fallback to fx, exported programs cut as they are; and
Mapping and dataclass values (batches, boundaries, outputs)."""

from __future__ import annotations

import copy
import dataclasses
import functools
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import schedcc
from schedcc import exporting
from schedcc.backends.distributed.engine import Engine as DistributedEngine
from schedcc.backends.local import Engine
from schedcc.backends.run.launch import spawn
from schedcc.backends.runtime.values import (
    call,
    concat,
    decode_spec,
    encode_spec,
    flatten,
    split,
    unflatten,
)
from schedcc.errors import ScheduleConfigError


def chain(segments, inputs):
    value = inputs
    for segment in segments:
        value = call(segment, value)
    return value


@dataclasses.dataclass
class Output:
    """A model output as Hugging Face returns one: a dataclass of tensors (and None)."""

    logits: torch.Tensor
    aux: torch.Tensor | None = None


def _keywords_only(forward):
    """A decorator like transformers' that hides `forward`'s signature behind **kwargs."""

    @functools.wraps(forward)
    def wrapped(self, **kwargs):
        return forward(self, **kwargs)

    return wrapped


class TiedLM(nn.Module):
    """A tiny LM: the head tied to the embedding, item assignment on a value (fx cannot trace
    that), a buffer and a tensor made in `forward`, a keyword-only forward, a dataclass out."""

    def __init__(self, vocab=11, width=6, num_blocks=3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(num_blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    @_keywords_only
    def forward(self, input_ids, mask):
        h = self.embed(input_ids)
        gate = torch.ones_like(h)
        gate[:, 0] = 2.0  # item assignment on a traced value
        h = h * gate * mask.unsqueeze(-1) + torch.tensor([0.25])
        h = h + 0.01 * torch.arange(h.shape[1], device=h.device).unsqueeze(-1)  # positions
        for block in self.blocks:
            h = h + torch.tanh(block(h)) * self.scale
        return Output(logits=self.head(self.norm(h)))


def _inputs(batch=4, length=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (batch, length), generator=gen)
    return {"input_ids": ids, "mask": torch.ones(batch, length, dtype=torch.float64)}


def _model():
    return TiedLM().double()


def test_fx_cannot_trace_it_but_export_cuts_it():
    """Without example_inputs (fx) the model is refused with the fix; with them it is cut, and
    the chained segments compute exactly what the model computes, on other shapes too."""
    with pytest.raises(ScheduleConfigError, match="pass example_inputs="):
        schedcc.split(_model(), ["blocks.1"])
    model = _model()
    segments = schedcc.split(model, ["blocks.1", "blocks.2"], example_inputs=_inputs())
    for batch, length in ((4, 5), (2, 9), (1, 3)):  # the batch and length stay free
        inputs = _inputs(batch, length, seed=batch)
        got, want = chain(segments, inputs), model(**inputs)
        assert type(got) is Output
        assert got.aux is None
        assert torch.equal(got.logits, want.logits)


def test_segments_hold_the_models_own_parameters_named_by_use():
    """The tie is one Parameter in the first and last segment, named there as the module using
    it names it; the buffer is the model's own; tied_groups reports the tie."""
    model = _model()
    first, middle, last = schedcc.split(model, ["blocks.1", "blocks.2"], example_inputs=_inputs())
    assert first.get_parameter("embed.weight") is model.embed.weight
    assert last.get_parameter("head.weight") is model.embed.weight
    assert middle.get_parameter("blocks.1.weight") is model.blocks[1].weight
    assert any(buffer is model.scale for buffer in first.buffers())
    assert schedcc.tied_groups([first, middle, last]) == [(0, 2)]
    own = {id(p) for p in model.parameters()}
    assert {id(p) for s in (first, middle, last) for p in s.parameters()} == own


def test_moved_segments_make_their_tensors_where_they_are():
    """The positions `forward` makes follow the segments to another device (meta here): the
    device seen while tracing is not baked into the cut."""
    segments = schedcc.split(_model(), ["blocks.1"], example_inputs=_inputs())
    inputs = {key: tensor.to("meta") for key, tensor in _inputs(2, 3).items()}
    out = chain([segment.to("meta") for segment in segments], inputs)
    assert out.logits.device.type == "meta"
    assert out.logits.shape == (2, 3, 11)


def test_segments_pickle_together_with_their_tie():
    """Exported segments pickled together (as for spawned ranks) keep the tie and compute the
    same."""
    import pickle

    model = _model()
    first, last = pickle.loads(
        pickle.dumps(schedcc.split(model, ["blocks.1"], example_inputs=_inputs()))
    )
    assert first.get_parameter("embed.weight") is last.get_parameter("head.weight")
    assert torch.equal(chain([first, last], _inputs()).logits, model(**_inputs()).logits)


def test_gradients_through_the_cut_equal_the_models():
    """Backward through the chained segments gives the model's own gradients, exactly."""
    model, reference = _model(), _model()
    segments = schedcc.split(model, ["blocks.2"], example_inputs=_inputs())
    inputs = _inputs(2, 7)
    chain(segments, inputs).logits.square().sum().backward()
    reference(**inputs).logits.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_an_exported_program_is_cut_as_it_is():
    """One export serves several cuts; its segments hold the exported model's Parameters."""
    model = _model()
    program = exporting.export(model, _inputs())
    two = schedcc.split(program, ["blocks.1"], example_inputs=_inputs())
    three = schedcc.split(program, ["blocks.1", "blocks.2"])
    assert two[0].get_parameter("embed.weight") is model.embed.weight
    assert torch.equal(chain(three, _inputs(3, 4)).logits, model(**_inputs(3, 4)).logits)
    with pytest.raises(ScheduleConfigError, match=r"'blocks\.7' is not a submodule of the exp"):
        schedcc.split(program, ["blocks.7"])
    with pytest.raises(ScheduleConfigError, match="not with tracer='fx'"):
        schedcc.split(program, ["blocks.1"], tracer="fx")


class Branchy(nn.Module):
    """Data-dependent control flow inside a block: export cannot capture it, fx leaves it be."""

    def __init__(self):
        super().__init__()
        self.a, self.branch, self.b = nn.Linear(2, 2), _Branch(), nn.Linear(2, 2)

    def forward(self, x):
        return self.b(self.branch(self.a(x)))


class _Branch(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.f, self.g = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        return self.g(self.f(self.f(x)))


def test_auto_falls_back_to_fx_and_export_alone_says_why():
    """Where export fails, "auto" cuts with fx (checked on the inputs); "export" raises export's
    reason; inputs the model fails on, a point called twice, an unknown tracer or export without
    inputs are refused."""
    model, x = Branchy(), torch.ones(3, 2)
    first, second = schedcc.split(model, ["b"], example_inputs=x)
    assert isinstance(first.a, nn.Linear)  # fx kept the submodule: an eager call
    assert torch.equal(second(*first(x)), model(x))
    with pytest.raises(ScheduleConfigError, match=r"torch\.export could not capture Branchy"):
        schedcc.split(model, ["b"], example_inputs=x, tracer="export")
    with pytest.raises(ScheduleConfigError, match=r"'f' is called 2 times .* torch\.export saw"):
        schedcc.split(Twice(), ["f"], example_inputs=x, tracer="export")
    with pytest.raises(ScheduleConfigError, match="Branchy's forward on example_inputs raised"):
        schedcc.split(model, ["b"], example_inputs=torch.ones(3, 5), tracer="export")
    with pytest.raises(ScheduleConfigError, match="tracer must be"):
        schedcc.split(model, ["b"], tracer="jit")
    with pytest.raises(ScheduleConfigError, match="tracer='export' needs example_inputs"):
        schedcc.split(model, ["b"], tracer="export")


def test_points_out_of_order_are_refused_with_the_order():
    """Export sees the call order; points given otherwise are refused with the right order."""
    with pytest.raises(ScheduleConfigError, match=r"use \['blocks.1', 'blocks.2'\]"):
        schedcc.split(_model(), ["blocks.2", "blocks.1"], example_inputs=_inputs(), tracer="export")


class Batch(dict):
    """Stands in for a tokenizer's BatchEncoding: not a dict exactly, so it reads as a Mapping."""


class Encoding:
    """A Mapping that is not a dict at all (BatchEncoding is a UserDict)."""

    def __init__(self, data):
        self.data = dict(data)

    def __getitem__(self, key):
        return self.data[key]

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)

    def keys(self):
        return self.data.keys()

    def items(self):
        return self.data.items()


import collections.abc  # noqa: E402

collections.abc.Mapping.register(Encoding)


def test_a_mapping_is_a_dict_of_keyword_arguments():
    """Any Mapping is called as keyword arguments, split into microbatches and joined as a
    dict."""
    encoding = Encoding({"a": torch.arange(4.0), "b": torch.ones(4)})
    assert torch.equal(call(lambda a, b: a - b, encoding), torch.arange(4.0) - 1)
    halves = split(encoding, 2)
    assert type(halves[0]) is dict
    assert halves[1]["a"].tolist() == [2.0, 3.0]
    assert torch.equal(concat(halves)["a"], torch.arange(4.0))
    assert type(unflatten(*flatten(Batch(x=torch.ones(1))))) is dict
    output = Output(logits=torch.ones(2))  # a dataclass is one argument, never keywords
    assert call(lambda value: value, output) is output


def test_a_dataclass_round_trips_and_crosses_the_wire():
    """A dataclass value keeps its class through flatten, microbatches and the spec's encoding;
    a class no imported module defines is refused on decoding."""
    value = Output(logits=torch.arange(6.0).reshape(3, 2))
    tensors, spec = flatten(value)
    assert unflatten(tensors, spec) == value
    assert decode_spec(encode_spec(spec)) == spec
    assert concat(split(value, 3)).logits.tolist() == value.logits.tolist()

    @dataclasses.dataclass
    class Local:  # its qualified name leads to no module attribute
        x: torch.Tensor

    with pytest.raises(ScheduleConfigError, match="not a dataclass of an imported module"):
        decode_spec(encode_spec(flatten(Local(torch.ones(1)))[1]))


class _Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3, dtype=torch.float64)

    def forward(self, x):
        h = self.linear(x)
        return Output(logits=h, aux=h.sum(-1))


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2, dtype=torch.float64)

    def forward(self, value):  # one argument: the dataclass
        return self.linear(value.logits) + value.aux.unsqueeze(-1)


def _dataclass_case():
    """Two segments passing an `Output` between them, Mapping batches, a 1f1b program."""
    torch.manual_seed(0)
    segments = [_Embed(), _Head()]
    gen = torch.Generator().manual_seed(2)
    data = [
        (Encoding({"x": torch.randn(4, 3, generator=gen, dtype=torch.float64)}),
         torch.randn(4, 2, generator=gen, dtype=torch.float64))
        for _ in range(2)
    ]  # fmt: skip
    return segments, data, schedcc.compile(schedcc.get_schedule("1f1b")(2, 2, 1, 2))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def test_a_dataclass_boundary_and_mapping_batches_train_on_the_local_engine():
    """A dataclass crossing a stage, Mapping inputs: equal to plain training."""
    segments, data, program = _dataclass_case()
    plain = copy.deepcopy(segments)
    opt = _sgd
    losses = list(Engine(program, segments, nn.functional.mse_loss, opt).train(data))
    plain_opt = opt([p for s in plain for p in s.parameters()])
    for (inputs, target), got in zip(data, losses):
        plain_opt.zero_grad()
        loss = nn.functional.mse_loss(plain[1](plain[0](inputs["x"])), target)
        loss.backward()
        plain_opt.step()
        assert got == pytest.approx(loss.item(), abs=1e-12)
    for mine, theirs in zip(segments, plain):
        for p, q in zip(mine.parameters(), theirs.parameters()):
            assert torch.allclose(p, q, atol=1e-12, rtol=0)


def _dataclass_worker(rank: int, world_size: int) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    segments, data, program = _dataclass_case()
    local = Engine(program, copy.deepcopy(segments), nn.functional.mse_loss, _sgd)
    expected = list(local.train(data))
    for p2p in ("gloo", "shm"):
        engine = DistributedEngine(
            program, copy.deepcopy(segments), nn.functional.mse_loss, _sgd, timeout=30, p2p=p2p
        )
        losses = list(engine.train(data))
        assert losses == pytest.approx(expected, abs=1e-12, rel=0), (p2p, rank)
    return 0


def test_a_dataclass_crosses_gloo_ranks():
    """The Output boundary travels between two gloo ranks (its class by name in the header),
    over gloo and shared memory: the local engine's losses."""
    assert spawn(_dataclass_worker, 2, grace=30, threads=1) == 0
