"""schedcc.split: any module cut at named submodules, its own Parameters, exact segments."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import schedcc
from schedcc.backends.runtime.values import call
from schedcc.errors import ScheduleConfigError
from schedcc.splitting import even_points


def chain(segments, inputs):
    """The segments run one after the other, each called on what the previous returned."""
    value = inputs
    for segment in segments:
        value = call(segment, value)
    return value


class Skip(nn.Module):
    """An embedding whose output skips two layers, a root parameter read twice, a norm reused."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, 4)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x, *, shift=0.0):
        x0 = self.norm(self.embed(x)) * self.scale + shift
        h = self.b(torch.tanh(self.a(x0)))
        return {"y": self.norm(self.c(h) + x0) * self.scale, "width": 4}


def test_split_is_lazy_and_public():
    """`schedcc.split` is the function, and importing schedcc still does not import torch."""
    code = "import sys, schedcc; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert schedcc.split is schedcc.splitting.split


def test_segments_hold_the_models_own_parameters():
    """Every parameter of every segment is the model's own object; together they are all of it."""
    model = Skip().double()
    segments = schedcc.split(model, ["b", "c"])
    own = {id(p) for p in model.parameters()}
    held = [{id(p) for p in s.parameters()} for s in segments]
    assert set().union(*held) == own
    assert all(ids <= own for ids in held)
    # the root parameter and the reused norm are read in segments 0 and 2: held by both
    assert segments[0].scale is segments[2].scale is model.scale
    assert segments[0].norm is segments[2].norm is model.norm


def test_a_skipped_value_passes_through_and_results_are_exact():
    """x0 crosses segment 1 untouched; the chained forward and backward equal the model's."""
    model, reference = Skip().double(), Skip().double()
    segments = schedcc.split(model, ["b", "c"])
    x = torch.randn(5, 3, dtype=torch.float64)
    inputs = {"x": x, "shift": 0.25}  # a dict: keyword arguments to segment 0
    out = chain(segments, inputs)
    want = reference(x, shift=0.25)
    assert out["width"] == 4
    assert torch.equal(out["y"], want["y"])
    assert len(call(segments[0], inputs)) == 2  # (x0, the input of b)
    out["y"].square().sum().backward()
    want["y"].square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_point_inside_a_container_is_reached():
    """A point two levels down cuts inside its parent, which is traced through."""
    torch.manual_seed(0)
    inner = [nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)) for _ in range(2)]
    model = nn.Sequential(*inner).double()
    segments = schedcc.split(model, ["0.2", "1.1"])
    x = torch.randn(3, 2, dtype=torch.float64)
    assert len(segments) == 3
    assert torch.equal(chain(segments, x), model(x))
    assert segments[1].get_submodule("1.0") is model[1][0]


def test_shapes_may_change_after_splitting():
    """Segments are not specialised to one shape: a longer batch runs through the same ones."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)).double()
    segments = schedcc.split(model, ["2"], example_inputs=torch.ones(2, 4, dtype=torch.float64))
    for rows in (1, 7):
        x = torch.randn(rows, 5, 4, dtype=torch.float64)
        assert torch.equal(chain(segments, x), model(x))


def test_no_points_give_one_segment():
    """Zero points is one segment that is the whole model."""
    model = Skip()
    (segment,) = schedcc.split(model, [])
    x = torch.randn(2, 3)
    assert torch.equal(segment(x)["y"], model(x)["y"])


class CallsTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.f, self.g = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        return self.g(self.f(self.f(x)))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Linear(2, 2)

    def forward(self, x):
        if x.sum() > 0:
            return self.f(x)
        return x


class Stateful(nn.Module):
    """A forward that reads Python state: tracing fixes the value it saw."""

    def __init__(self):
        super().__init__()
        self.f, self.g, self.calls = nn.Linear(2, 2), nn.Linear(2, 2), 0

    def forward(self, x):
        self.calls += 1
        return self.g(self.f(x) * self.calls)


@pytest.mark.parametrize(
    ("model", "points", "message"),
    [
        (Skip(), ["d"], r"'d' is not a submodule of Skip \(its children: embed, a"),
        (Skip(), ["c", "b"], r"not in the order the model calls them; use \['b', 'c'\]"),
        (Skip(), ["b", "b"], "twice"),
        (Skip(), "b", "must be a list of submodule names"),
        (Skip(), [""], "is not a submodule"),
        (nn.Sequential(nn.Sequential(nn.Linear(2, 2))), ["0", "0.0"], "lies inside"),
        (CallsTwice(), ["f"], "'f' is called 2 times"),
        (Branchy(), ["f"], "could not trace Branchy"),
    ],
)
def test_bad_points_are_typed_errors(model, points, message):
    """Unknown, misordered, repeated, nested or re-called points, and untraceable glue, each
    raise ScheduleConfigError saying what to change."""
    with pytest.raises(ScheduleConfigError, match=message):
        schedcc.split(model, points)


def test_example_inputs_catch_what_tracing_fixed():
    """With example_inputs, segments that compute something else than the model are refused
    (torch.fx traced the counter's value before the check's call of the model)."""
    with pytest.raises(ScheduleConfigError, match="do not compute what the model computes"):
        schedcc.split(Stateful(), ["g"], example_inputs=torch.ones(1, 2), tracer="fx")


def test_even_points_spread_a_module_list():
    """even_points cuts the largest module list into near-equal runs, larger first."""
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])
    wrapper = nn.Module()
    wrapper.layers = model
    assert even_points(wrapper, 2) == ["layers.3"]
    assert even_points(wrapper, 5) == ["layers.1", "layers.2", "layers.3", "layers.4"]
    with pytest.raises(ScheduleConfigError, match="cannot cut the 5 entries"):
        even_points(wrapper, 6)
    with pytest.raises(ScheduleConfigError, match="no ModuleList or Sequential named 'x'"):
        even_points(wrapper, 2, container="x")
