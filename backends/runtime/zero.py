"""Data-parallel gradient reduction for `StageRuntime`, and under ZeRO the flat shards.

[Note: contiguous gradient buckets] Each chunk's gradients live in one flat buffer in parameter
order, and every parameter's `.grad` is a view into it, so autograd (and weight stashing's
`accumulate`) sums each backward straight into the buffer and a reduction needs no `torch.cat`
and no copy back. The buffer is made, zeroed, when a weight-gradient compute of the chunk finds
none (a parameter no backward reaches then holds zeros, as the reduction always counted a
missing `.grad`), and dropped where the gradients were set to None before it existed: at the step
without ZeRO (the optimizer reads the views), at the wait that follows the reduction under ZeRO.
Under ZeRO it is padded to `size * shard`, rank r's shard being its r-th slice; under ZeRO-1,
which reduces each chunk once per batch, the shard's `.grad` is that slice of the buffer (as
Megatron-LM's distributed optimizer views its gradient buffer), so the buffer lives on to the
step and nothing else holds a gradient.

The buffer is cut into buckets of about `bucket_bytes` at parameter boundaries, from the last
parameter back (the order a backward finishes them). `ReduceGrads(c)` comes after the chunk's
last weight gradient of its batch and after its `ReduceTied`, so every bucket is final there:
`reduce` launches them all asynchronously (`Collectives.all_reduce_async`, or under ZeRO
`reduce_scatter_async`) and returns. They are waited only where the program needs the sums: the
`GradNorm` and the `OptimizerStep`, the chunk's `GatherParams` or `Reshard`, or (ZeRO-2 and 3,
which reduce after every weight gradient) the chunk's next weight-gradient compute, which then
reuses the buffer zeroed. Under ZeRO-2 and 3 a wait adds this rank's slice into its shard's own
`.grad` (made at the first launch of the batch; the sums of the batch's reduce-scatters are
added in order) and, unless a weight gradient reuses it, drops the buffer. The
launch is not moved earlier, into the backward (as torch DDP's hooks do): `ReduceGrads` is where
the program says the gradients are final, and the compiler already places it right after the
last weight gradient, so the reduction overlaps what the stage computes after it (the other
chunks' backwards, the drain) and the rest of the pipeline. Neither the buckets nor the early
launch change a sum: each element is summed on its own, in the collectives' order.

Under ZeRO-3 (`release=True`) the module's parameters hold no data between uses: `release`
points each one at an empty tensor (the Parameter objects stay, so autograd and the caller's
references see the same parameters), and `unshard` all-gathers the shards into one flat buffer
that the parameters (and, until the release, this rank's shard) view: launched in place (the
shard is copied into its slice first) and waited by `ready`, which the chunk's first compute
calls, so the gather runs while the stage computes what comes before. The shapes are recorded
once, so sizes never depend on what is held.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from schedcc.errors import ScheduleConfigError
from schedcc.ir import ReduceGrads

if TYPE_CHECKING:
    from schedcc.backends.runtime.collectives import Collectives, Work

__all__ = ["BUCKET_BYTES", "GradBuffer", "Reducer", "buckets"]

#: Bytes per gradient bucket unless the engine is given `bucket_bytes` (torch DDP's default).
BUCKET_BYTES = 25 * 2**20


def buckets(numels: Sequence[int], element_size: int, bucket_bytes: int, length: int):
    """The `(start, stop)` ranges of a flat buffer of `length` elements holding parameters of
    `numels` elements in order: cut at parameter boundaries, from the last parameter back, each
    closed once it holds `bucket_bytes` (a larger parameter is a bucket alone); the first range
    also covers the padding past the parameters. `[]` for an empty buffer.

    >>> buckets([4, 4, 4], 8, 64, 14)
    [(4, 14), (0, 4)]
    """
    if length == 0:
        return []
    bounds, stop, size = [], length, 0
    offset = sum(numels)
    for n in reversed(numels):
        offset -= n
        size += n * element_size
        if size >= bucket_bytes and offset > 0:
            bounds.append((offset, stop))
            stop, size = offset, 0
    if stop > 0 or not bounds:
        bounds.append((0, stop))
    return bounds


class GradBuffer:
    """One chunk's contiguous gradients ([Note: contiguous gradient buckets]).

    Args:
        params: the chunk's parameters, in order.
        shapes: their whole shapes (under ZeRO-3 a released parameter holds no data).
        length: the buffer's length (under ZeRO padded to `size * shard`).
        bucket_bytes: about how many bytes a bucket holds.
    """

    def __init__(self, params, shapes, length: int, bucket_bytes: int) -> None:
        self.params = list(params)
        self.shapes = list(shapes)
        numels = [shape.numel() for shape in self.shapes]
        self.offsets = list(itertools.accumulate(numels, initial=0))[:-1]
        self.length = length
        first = self.params[0] if self.params else None
        self.dtype = first.dtype if first is not None else torch.get_default_dtype()
        self.device = first.device if first is not None else torch.device("cpu")
        element = torch.empty((), dtype=self.dtype).element_size()
        #: the `(start, stop)` of each bucket, in launch order (the last parameters first)
        self.bounds = buckets(numels, element, bucket_bytes, length)
        #: the buffer, or None while the chunk holds no gradients
        self.flat: torch.Tensor | None = None
        #: each parameter's view of `flat` (made with it: `attach` runs at every backward)
        self.views: list[torch.Tensor] = []
        #: the launched reductions not yet waited, one per bucket
        self.pending: list[Work] = []
        #: whether the buffer's sums were taken (its next weight gradient starts from zeros)
        self.spent = False

    def attach(self) -> torch.Tensor:
        """The buffer, made (zeroed) if the chunk holds none, with every parameter's `.grad`
        its view; a `.grad` something else put in its place is copied in first."""
        if self.flat is None:
            flat = self.flat = torch.zeros(self.length, dtype=self.dtype, device=self.device)
            self.views = [
                flat[offset : offset + shape.numel()].view(shape)
                for shape, offset in zip(self.shapes, self.offsets)
            ]
            self.spent = False
        for p, view in zip(self.params, self.views):
            grad = p.grad
            if grad is not view:
                if grad is not None:
                    view.copy_(grad)
                p.grad = view
        return self.flat

    def drop(self) -> None:
        """Free the buffer: no parameter holds a gradient."""
        for p in self.params:
            p.grad = None
        self.flat = None
        self.views = []
        self.spent = False


class Reducer:
    """Reduces one stage's gradients over its data-parallel group, chunk by chunk.

    Args:
        modules: the stage's segments, by chunk.
        collectives: communication over the stage's data-parallel group.
        zero: keep a flat shard per chunk (`shards`) for the optimizer to step: the ZeRO level
            (1: one reduce-scatter per chunk and batch, whose result the shard's `.grad` views
            in the buffer; 2 and 3: one per weight gradient, added into the shard's own
            `.grad`), or True for 2.
        release: ZeRO-3: the modules' parameters start released (see `release`).
        bucket_bytes: about how many bytes of gradients one launched reduction carries.
        reduced: whether the program reduces this stage's gradients (only then must each
            chunk's parameters share a dtype and a device).

    Raises:
        ScheduleConfigError: `bucket_bytes` is not a positive integer, or a chunk's parameters
            differ in dtype or device (its gradients share one buffer).
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        collectives: Collectives,
        *,
        zero: int,
        release: bool = False,
        bucket_bytes: int = BUCKET_BYTES,
        reduced: bool = True,
    ) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ScheduleConfigError(
                f"bucket_bytes must be a positive number of bytes, got {bucket_bytes!r}"
            )
        self._modules = modules
        self._collectives = collectives
        self._zero = 2 if zero is True else int(zero)
        #: per chunk, the shapes of its parameters in `parameters()` order
        self.shapes = [[p.shape for p in mod.parameters()] for mod in modules]
        self.shards: list[nn.Parameter] = []
        if zero:
            self.shards = [self._make_shard(c) for c in range(len(modules))]
        self.whole = [True] * len(modules)
        self.grads = [
            GradBuffer(mod.parameters(), shapes, self._length(c), bucket_bytes)
            for c, (mod, shapes) in enumerate(zip(modules, self.shapes))
        ]
        if reduced:
            for c, mod in enumerate(modules):
                _check_one_kind(c, list(mod.parameters()))
        #: this run's ("launch" or "wait", chunk, bucket) of reductions and ("gather" or
        #: "gathered", chunk, 0) of ZeRO-3's all-gathers, in order (for tests and traces)
        self.events: list[tuple[str, int, int]] = []
        #: the shards whose `.grad` this batch's first wait sets (rather than adds to)
        self._fresh = [False] * len(modules)
        #: the chunks whose reductions are in flight, in launch order
        self._launched: list[int] = []
        #: ZeRO-3: the launched all-gathers of the chunks' `unshard`, by chunk
        self._gathers: dict[int, Work] = {}
        if release:
            for c in range(len(modules)):
                self.release(c)

    # -- gradients ------------------------------------------------------------------------------

    def prepare(self, c: int) -> None:
        """Before a weight-gradient compute of chunk c: its launched reductions waited (the
        buffer is written next), and its `.grad`s views of a buffer that holds what is still
        to be reduced (under ZeRO zeros after a reduction was taken)."""
        grads = self.grads[c]
        self._finish(c)
        if grads.spent:
            if self._zero:  # the sums went to the shard's `.grad`: the buffer starts over
                grads.flat.zero_()  # type: ignore[union-attr]
            # without ZeRO the `.grad`s hold the sums, and later gradients add to them (one
            # replica may reduce a chunk more than once a batch)
            grads.spent = False
        grads.attach()

    def reduce(self, c: int) -> None:
        """Launch the sum of chunk c's gradients over the group, bucket by bucket, and return;
        the sums are there once `wait` (or `prepare`, `release`, `drop_grads`) has taken them
        (under ZeRO into this rank's shard's `.grad`)."""
        coll, grads = self._collectives, self.grads[c]
        self._finish(c)  # at most one reduction of a chunk in flight
        flat = grads.attach()
        if self._zero:
            target = self.shards[c]
            if self._zero == 1:  # the one reduction of the batch: this rank's slice is the shard's
                size, rank = target.numel(), coll.rank
                target.grad = flat[rank * size : (rank + 1) * size]
            elif target.grad is None:
                target.grad = torch.empty_like(target)
                self._fresh[c] = True
        for j, (start, stop) in enumerate(grads.bounds):
            if self._zero:
                work = coll.reduce_scatter_async(flat, start, stop)
            else:
                work = coll.all_reduce_async(flat[start:stop])
            grads.pending.append(work)
            self.events.append(("launch", c, j))
        if grads.pending:
            self._launched.append(c)

    def wait(self, c: int | None = None) -> None:
        """Take chunk c's (None: every chunk's, in launch order) launched reductions: the
        `.grad`s hold the sums (under ZeRO this rank's shard's `.grad` takes its slice, and the
        buffer is dropped). Gradients not yet reduced stay: a `Gather` the program places before
        its chunk's `Reduce` must not lose what the backwards accumulated."""
        chunks = (c,) if c is not None else [*self._launched, *range(len(self.grads))]
        for chunk in dict.fromkeys(chunks):
            self._finish(chunk)
            if self._zero and self.grads[chunk].spent:
                self.grads[chunk].drop()

    def drop_grads(self) -> None:
        """After the step: every chunk's gradients dropped (waited first, if in flight)."""
        self.wait()
        for grads in self.grads:
            grads.drop()
        self._fresh = [False] * len(self.grads)

    def reset(self) -> None:
        """A new run: its events start empty."""
        self.events = []

    def _finish(self, c: int) -> None:
        grads = self.grads[c]
        if not grads.pending:
            return
        for j, work in enumerate(grads.pending):
            try:
                work.wait()
            except RuntimeError as exc:  # the failure of a collective launched at the Reduce
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise RuntimeError(f"the {ReduceGrads(c)} launched earlier: {first}") from exc
            self.events.append(("wait", c, j))
        grads.pending = []
        grads.spent = True
        self._launched.remove(c)
        if self._zero >= 2:
            size, rank = self._shard_size(c), self._collectives.rank
            mine = grads.flat[rank * size : (rank + 1) * size]  # type: ignore[index]
            target = self.shards[c].grad
            if self._fresh[c]:
                target.copy_(mine)  # type: ignore[union-attr]
                self._fresh[c] = False
            else:
                target.add_(mine)  # type: ignore[union-attr]

    def _length(self, c: int) -> int:
        if self._zero:
            return self._shard_size(c) * self._collectives.size
        return self._numel(c)

    # -- parameters -----------------------------------------------------------------------------

    def gather(self, c: int) -> None:
        """Copy every rank's shard of chunk c, in rank order, into the module's parameters."""
        full = self._collectives.all_gather(self.shards[c].detach())
        offset = 0
        with torch.no_grad():
            for p in self._modules[c].parameters():
                n = p.numel()
                p.copy_(full[offset : offset + n].view_as(p))
                offset += n

    def unshard(self, c: int, full: torch.Tensor | None = None, *, alias: bool = True) -> None:
        """ZeRO-3: make chunk c's parameters whole again from every rank's shard (`full`: their
        rank-ordered concatenation, when the caller has it; else an all-gather). `alias`: the
        shard becomes its slice of the gathered buffer until the release (no second copy while
        whole), so the parameters and the shard must not be written meanwhile; the all-gather
        is then launched asynchronously into that buffer and waited by `ready` (the chunk's
        first compute calls it), so it runs while the stage computes what comes before."""
        shard = self.shards[c]
        size, rank = shard.numel(), self._collectives.rank
        if full is None and alias:
            full = shard.new_empty(size * self._collectives.size)
            mine = full[rank * size : (rank + 1) * size]
            mine.copy_(shard.detach())
            shard.data = mine
            self._gathers[c] = self._collectives.all_gather_async(full)
            self.events.append(("gather", c, 0))
        elif full is None:
            full = self._collectives.all_gather(shard.detach())
        elif alias:
            shard.data = full[rank * size : (rank + 1) * size]
        offset = 0
        for p, shape in zip(self._modules[c].parameters(), self.shapes[c]):
            n = shape.numel()
            p.data = full[offset : offset + n].view(shape)
            offset += n
        self.whole[c] = True

    def ready(self, c: int) -> None:
        """Before chunk c's parameters are read: the all-gather its `unshard` launched waited."""
        work = self._gathers.pop(c, None)
        if work is not None:
            work.wait()
            self.events.append(("gathered", c, 0))

    def release(self, c: int) -> None:
        """ZeRO-3: drop chunk c's whole parameters (and its whole gradients, their reduction
        taken first: `wait`); this rank keeps only its shard."""
        self.ready(c)
        self.wait(c)
        if self.whole[c] and self.shards:
            self.shards[c].data = self.shards[c].data.clone()  # out of the gathered buffer
        for p in self._modules[c].parameters():
            p.data = p.data.new_empty(0)
        self.whole[c] = False

    def unshard_all(self, full: Sequence[torch.Tensor] | None = None) -> None:
        """ZeRO-3, between runs: make every chunk's parameters whole (`full[c]`: chunk c's
        shards of every rank concatenated in rank order, when the caller has them; else an
        all-gather each). The shard keeps its own copy: writes to the parameters are not kept."""
        for c in range(len(self._modules)):
            self.unshard(c, None if full is None else full[c], alias=False)

    def release_all(self) -> None:
        """ZeRO-3, between runs: release every chunk's whole parameters again."""
        for c in range(len(self._modules)):
            self.release(c)

    @contextmanager
    def placeholders(self) -> Iterator[None]:
        """Released chunks get whole-shaped (uninitialised) parameters for the duration, and
        are released again after; what is written into them meanwhile is lost unless copied
        into the shards (`refresh_shards`)."""
        released = [c for c, whole in enumerate(self.whole) if not whole]
        for c in released:
            for p, shape in zip(self._modules[c].parameters(), self.shapes[c]):
                p.data = p.data.new_empty(shape)
            self.whole[c] = True
        try:
            yield
        finally:
            for c in released:
                self.release(c)

    def refresh_shards(self) -> None:
        """Set each shard from the module's parameters (after loading new weights)."""
        with torch.no_grad():
            for c, shard in enumerate(self.shards):
                size, rank = shard.numel(), self._collectives.rank
                flat = self._flat_params(c, size * self._collectives.size)
                shard.copy_(flat[rank * size : (rank + 1) * size])

    def _numel(self, c: int) -> int:
        return sum(shape.numel() for shape in self.shapes[c])

    def _shard_size(self, c: int) -> int:
        return max(1, math.ceil(self._numel(c) / self._collectives.size))

    def _make_shard(self, c: int) -> nn.Parameter:
        size = self._shard_size(c)
        rank = self._collectives.rank
        with torch.no_grad():
            flat = self._flat_params(c, size * self._collectives.size)
            return nn.Parameter(flat[rank * size : (rank + 1) * size].clone())

    def _flat_params(self, c: int, length: int) -> torch.Tensor:
        params = list(self._modules[c].parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
        return torch.cat([flat, flat.new_zeros(length - flat.numel())])


def _check_one_kind(c: int, params: list[nn.Parameter]) -> None:
    """Raise unless chunk c's parameters share a dtype and a device (one gradient buffer)."""
    kinds = sorted({(str(p.dtype), str(p.device)) for p in params})
    if len(kinds) > 1:
        raise ScheduleConfigError(
            f"chunk {c}'s parameters differ in dtype or device ({kinds}); its gradients are "
            "reduced in one contiguous buffer: give every parameter of a segment one dtype and "
            "one device"
        )
