"""How many bytes of activations a forward saves for its backward, for `StageRuntime`.

[Note: activation bytes are measured once] Saved-tensor hooks count the bytes a forward saves for
its backward (views count their own bytes, a tensor saved twice counts once, parameters do not
count). A Python hook on every saved tensor costs time, so the count is taken on the first forward
of each signature (chunk, input shape/dtype/strides/requires_grad, the target's for the loss, the
module's training flag, grad mode) and reused for later forwards with the same signature: exact
for any module whose saved tensors depend on shapes, not on values (a data-dependent module, e.g.
a router that drops tokens, gets the first microbatch's count).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

import torch

__all__ = ["SavedBytes"]


class SavedBytes:
    """Runs forwards and says how many activation bytes each saved (see the note above).

    The counts are kept per signature for the runtime's whole life, across runs.
    """

    def __init__(self) -> None:
        self._by_signature: dict[Hashable, int] = {}

    def run(
        self,
        signature: Hashable,
        params: Iterable[torch.Tensor],
        forward: Callable[[], torch.Tensor],
    ) -> tuple[torch.Tensor, int]:
        """`forward()`'s result and the bytes it saved, not counting the tensors in `params`."""
        num_bytes = self._by_signature.get(signature)
        if num_bytes is not None:
            return forward(), num_bytes
        skip = {t.untyped_storage().data_ptr() for t in params}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            # A view counts its own bytes (a microbatch is a view of the whole batch); a tensor
            # saved twice counts once; parameters are weights, not activations.
            if t.untyped_storage().data_ptr() not in skip:
                seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
        num_bytes = self._by_signature[signature] = sum(seen.values())
        return out, num_bytes
