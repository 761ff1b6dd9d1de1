"""Hugging Face models cut unmodified by `schedcc.split` (torch.export): GPT-2, Llama tied and
untied, BERT masked LM and T5, into 2 and 4 segments, trained on BatchEncoding batches with a
loss on the ModelOutput; float64 pipelined training equals plain training of the model to 1e-9
on the local engine (1f1b, interleaved-1f1b, zb-v) and on two gloo ranks."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _hf import FAMILIES, batches, build, points, token_loss  # noqa: E402

import schedcc  # noqa: E402
from schedcc import exporting  # noqa: E402
from schedcc.backends.distributed.engine import Engine as DistributedEngine  # noqa: E402
from schedcc.backends.local import Engine  # noqa: E402
from schedcc.backends.run.launch import spawn  # noqa: E402
from schedcc.errors import ScheduleConfigError  # noqa: E402

#: (schedule, num_chunks): 1f1b cuts into 2 segments, the others into 4.
SCHEDULES = [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2)]

#: family -> the tie groups its 2- and 4-segment cuts must report.
TIES = {
    "gpt2": ([(0, 1)], [(0, 3)]),
    "llama-tied": ([(0, 1)], [(0, 3)]),
    "llama-untied": ([], []),
    "bert": ([(0, 1)], [(0, 3)]),
    "t5": ([(0, 1)], [(0, 1, 3)]),
}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.5)


_EXPORTS: dict = {}
_CUTS: dict = {}


def _cut(name: str, num_segments: int):
    """`(model, segments)` of family `name` cut into `num_segments`: one export per family,
    cut as many ways as asked, each cut made once per module and copied for each test."""
    if name not in _EXPORTS:
        model = build(name)
        example = batches(name, 1, 2)[0][0]
        _EXPORTS[name] = model, example, exporting.export(model, example)
    if (name, num_segments) not in _CUTS:
        model, example, program = _EXPORTS[name]
        cut_points = points(name, num_segments)
        segments = schedcc.split(program, cut_points, example_inputs=example)
        _CUTS[name, num_segments] = model, segments
    return copy.deepcopy(_CUTS[name, num_segments])  # one copy: ties stay ties


@pytest.fixture(scope="module")
def cut():
    """The module's cache of exported cuts (`_cut`), cleared at its end; one thread meanwhile
    (these models are tiny, and threads only contend on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _cut
    torch.set_num_threads(threads)
    _EXPORTS.clear()
    _CUTS.clear()


def _train_plain(model, data) -> list[float]:
    """The model itself, trained on whole batches: what the pipeline must equal.

    The gradient of the mean token loss is taken as the engines take it, the summed loss's
    gradient divided by the count ([Note: the count divides at the step]): T5's layer norm
    computes in float32, so a gradient scaled by 1/count on its way down rounds differently
    there, by about 1e-8, which is the model's own precision and not the pipeline's.
    """
    opt = _sgd(model.parameters())
    losses = []
    for inputs, labels in data:
        opt.zero_grad()
        total, count = token_loss(model(**inputs), labels)
        total.backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= count
        opt.step()
        losses.append((total / count).item())
    return losses


def _assert_same(model, plain) -> None:
    for name, p in model.named_parameters():
        q = plain.get_parameter(name)
        assert torch.allclose(p, q, atol=1e-9, rtol=0), (name, (p - q).abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_cuts_keep_the_models_own_parameters_and_ties(cut, family):
    """Every segment parameter is the model's own object, the tie groups are the model's, and
    the last segment returns the model's ModelOutput."""
    for index, n in enumerate((2, 4)):
        model, segments = cut(family, n)
        own = {id(p) for p in model.parameters()}
        assert all(id(p) in own for s in segments for p in s.parameters())
        assert schedcc.tied_groups(segments) == TIES[family][index]
        for size, length in ((4, 5), (1, 1)):  # other batch sizes and lengths than exported
            inputs, _ = batches(family, 1, size, length=length)[0]
            value = inputs
            for segment in segments:
                value = schedcc.backends.runtime.values.call(segment, value)
            want = model(**inputs)
            assert type(value) is type(want)
            assert torch.equal(value.logits, want.logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_moved_segments_make_their_tensors_where_they_are(cut, family):
    """Segments exported on the CPU and moved (to the meta device here, a rank's GPU in a run)
    create their masks and positions there: no device was baked into the cut."""
    _, segments = cut(family, 4)
    inputs, _ = batches(family, 1, 3)[0]
    value = {key: tensor.to("meta") for key, tensor in inputs.items()}
    for segment in segments:
        value = schedcc.backends.runtime.values.call(segment.to("meta"), value)
    assert value.logits.device.type == "meta"
    assert (
        value.logits.shape[:2]
        == inputs["decoder_input_ids" if family == "t5" else "input_ids"].shape
    )


@pytest.mark.parametrize(("schedule_name", "v"), SCHEDULES)
@pytest.mark.parametrize("family", FAMILIES)
def test_pipelined_training_equals_plain_training(cut, family, schedule_name, v):
    """Two steps of 2-stage training of the cut model (on batches of two lengths) equal two
    plain steps of the model."""
    n = 2 * v
    model, segments = cut(family, n)
    plain = copy.deepcopy(model)
    data = batches(family, 1, 4) + batches(family, 1, 4, length=5, seed=2)
    schedule = schedcc.get_schedule(schedule_name)(2, 2, v, 2)
    program = schedcc.compile(schedule, tied=schedcc.tied_groups(segments))
    losses = list(Engine(program, segments, token_loss, _sgd).train(data))
    expected = _train_plain(plain, data)
    assert losses == pytest.approx(expected, abs=1e-9, rel=0)
    assert losses[1] != losses[0]  # the step changed the weights
    _assert_same(model, plain)


def test_an_unmodified_gpt2_is_cut_by_split(cut):
    """`split(GPT2LMHeadModel(config), ["transformer.h.2"], example_inputs=...)` cuts the model
    itself: the head's tie to the embedding is one Parameter in both segments."""
    model = build("gpt2")
    inputs = batches("gpt2", 1, 2)[0][0]
    first, second = schedcc.split(model, ["transformer.h.2"], example_inputs=inputs)
    assert first.get_parameter("transformer.wte.weight") is model.transformer.wte.weight
    assert second.get_parameter("lm_head.weight") is model.transformer.wte.weight
    assert schedcc.tied_groups([first, second]) == [(0, 1)]


def test_the_bare_gpt2_model_is_cut_too(cut):
    """`GPT2Model` (item assignment on a traced value: fx fails) is cut at `h.2`; the last
    segment returns its ModelOutput, the hidden states exactly the model's."""
    model = build("gpt2").transformer
    inputs = batches("gpt2", 1, 2)[0][0]
    segments = schedcc.split(model, ["h.2"], example_inputs=inputs)
    other, _ = batches("gpt2", 1, 3, length=6, seed=5)[0]
    value = segments[1](*segments[0](**other))
    assert type(value).__name__ == "BaseModelOutputWithPastAndCrossAttentions"
    assert torch.equal(value.last_hidden_state, model(**other).last_hidden_state)


def test_gpt2_without_example_inputs_says_to_give_them():
    """fx cannot trace GPT-2's decorated forward; the error says to pass example_inputs."""
    with pytest.raises(ScheduleConfigError, match="pass example_inputs="):
        schedcc.split(build("gpt2"), ["transformer.h.2"])


def test_partition_of_an_hf_model_names_a_split_that_works():
    """partition refuses a GPT2LMHeadModel and names split with example_inputs."""
    with pytest.raises(ScheduleConfigError, match=r"split\(model, \['transformer.h.2'\], exam"):
        schedcc.partition(build("gpt2"), 2)


def test_the_hf_example_trains(cut, capsys):
    """examples/train_hf_gpt2.py runs a few steps on the local engine and its loss falls."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "train_hf_gpt2.py"
    spec = importlib.util.spec_from_file_location("train_hf_gpt2", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(steps=3)
    assert len(losses) == 3
    assert losses[-1] < losses[0]
    assert capsys.readouterr().out.splitlines()[-1] == f"step 2: loss {losses[-1]:.4f}"


def _gloo_worker(rank: int, world_size: int) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    for family in ("gpt2", "llama-untied", "bert", "t5"):
        model, segments = copy.deepcopy(_CUTS[family, 2])
        plain = copy.deepcopy(model)
        data = batches(family, 2, 4)
        program = schedcc.compile(
            schedcc.get_schedule("1f1b")(2, 2, 1, 2), tied=schedcc.tied_groups(segments)
        )
        engine = DistributedEngine(program, segments, token_loss, _sgd, timeout=30)
        losses = list(engine.train(data))
        expected = _train_plain(plain, data)
        assert losses == pytest.approx(expected, abs=1e-9, rel=0), (family, rank)
        for name, p in segments[rank].named_parameters():
            q = plain.get_parameter(name)
            assert torch.allclose(p, q, atol=1e-9, rtol=0), (family, rank, name)
    return 0


def test_every_family_on_two_gloo_ranks(cut):
    """GPT-2, Llama, BERT and T5, each cut in two, on 2 gloo ranks: plain training's losses and
    weights (each rank checks its own segment)."""
    for family in ("gpt2", "llama-untied", "bert", "t5"):
        cut(family, 2)  # exported here; the forked ranks inherit the cuts
    assert spawn(_gloo_worker, 2, grace=30, threads=1) == 0
