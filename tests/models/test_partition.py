"""schedcc.partition: contiguous, balanced segments that share the model's layers."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import schedcc
from schedcc.errors import ScheduleConfigError
from schedcc.partitioning import PartitionError, segment_bounds


def _model(widths=(8, 8, 8, 8)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


def test_partition_is_lazy_and_public():
    """`schedcc.partition` is the function, and importing schedcc still does not import torch."""
    code = "import sys, schedcc; schedcc.partition; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert callable(schedcc.partition)


def test_segments_hold_the_models_own_layers_in_order():
    """The segments, concatenated, are the model's layers (the same objects, in order)."""
    model = _model()
    segments = schedcc.partition(model, 3)
    assert [layer for s in segments for layer in s] == list(model)
    x = torch.randn(2, 8)
    torch.testing.assert_close(nn.Sequential(*segments)(x), model(x))


def test_parameters_method_balances_parameter_counts():
    """A big layer gets a segment of its own; layers without parameters go with a neighbour."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 2))
    segments = schedcc.partition(model, 3)
    counts = [sum(p.numel() for p in s.parameters()) for s in segments]
    assert counts == [6, 192, 130]


def test_uniform_method_balances_layer_counts():
    """uniform gives layer counts that differ by at most one, larger segments first."""
    assert [len(s) for s in schedcc.partition(_model(), 4, "uniform")] == [2, 2, 1, 1]


def test_explicit_boundaries_cut_where_told():
    """A list of n-1 start indices cuts exactly there."""
    assert [len(s) for s in schedcc.partition(list(_model()), 3, [1, 4])] == [1, 3, 2]


@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 9))
def test_balanced_bounds_are_optimal(sizes, n):
    """The parameter balance minimises the largest segment over every contiguous cut."""
    if n > len(sizes):
        with pytest.raises(PartitionError):
            segment_bounds(sizes, n)
        return
    bounds = segment_bounds(sizes, n)
    assert bounds[0] == 0
    assert bounds[-1] == len(sizes)
    assert all(lo < hi for lo, hi in itertools.pairwise(bounds))
    worst = max(sum(sizes[lo:hi]) for lo, hi in itertools.pairwise(bounds))
    assert worst <= _brute_force_best(sizes, n)


def _brute_force_best(sizes, n) -> int:
    from itertools import combinations

    best = None
    for cuts in combinations(range(1, len(sizes)), n - 1):
        b = [0, *cuts, len(sizes)]
        worst = max(sum(sizes[lo:hi]) for lo, hi in itertools.pairwise(b))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize(
    ("n", "method", "message"),
    [
        (7, "parameters", "cannot cut 6 layer"),
        (0, "uniform", "positive integer"),
        (2, "size", "unknown partition method"),
        (3, [1], "give 2 integer layer indices"),
        (3, [3, 3], "increase strictly"),
        (2, [6], "increase strictly"),
    ],
)
def test_bad_requests_are_typed_errors(n, method, message):
    """Too many segments, bad counts, unknown methods and bad boundaries each say what to change."""
    with pytest.raises(ScheduleConfigError, match=message):
        schedcc.partition(_model(), n, method)


def test_non_modules_are_refused():
    """A list holding something that is not a module is named."""
    with pytest.raises(PartitionError, match="layer 1 is a int"):
        schedcc.partition([nn.ReLU(), 3], 1)


class _Tower(nn.Module):
    """Not a Sequential: its forward decides how the layers are called."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_a_module_it_cannot_cut_points_to_split():
    """A module that is not a Sequential is refused with the `schedcc.split` call to use instead,
    never a bare TypeError."""
    split_call = r"schedcc\.split\(model, \['layers\.2'\], example_inputs=inputs\)"
    with pytest.raises(ScheduleConfigError, match=split_call):
        schedcc.partition(_Tower(), 2)
    with pytest.raises(ScheduleConfigError, match=r"schedcc\.split\(model, \[the names"):
        schedcc.partition(nn.Linear(2, 2), 2)
    with pytest.raises(PartitionError, match="got an object of type int"):
        schedcc.partition(3, 1)


def test_a_module_list_is_still_a_list_of_layers():
    """An nn.ModuleList is cut like the list of its layers."""
    assert [len(s) for s in schedcc.partition(nn.ModuleList(_model()), 2, "uniform")] == [3, 3]
