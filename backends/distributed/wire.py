"""A message's header on the wire, and how a gloo receive tells a header from data.

A header is one int64 tensor: `[MAGIC, number, spec length, spec words..., meta words...]`
(`backends.runtime.values.encode_spec` / `encode_meta`). `number` is the message's place in its
stream, counted over every run, so a header that arrives for another message is caught.

[Note: telling a header from data over gloo] Gloo receives a message into a buffer at least as
large (a smaller one aborts the process), and says nothing of how many bytes came. A gloo receive
posted ahead expects its basis's tensors (`backends.distributed.streams`); its first buffer is 8
bytes longer than the basis's first tensor, and those 8 bytes hold `SENTINEL`. Data of the basis's
shapes leaves them alone. A changed message instead sends, in place of the first tensor, a
*marker*: exactly as many bytes as that buffer holds, ending in `MARK`, then a dummy of each other
expected tensor's size, and then its header and tensors on the side tag, where the receiver posts
exact buffers once it has read the header. A receive with no basis (or a basis without tensors)
posts a header buffer of `HEAD_WORDS` instead, and the sender always sends the header there.
Nothing extra travels for a message of the basis's shapes.
"""

from __future__ import annotations

import torch

from schedcc.backends.runtime.boundary import Message
from schedcc.backends.runtime.values import (
    Spec,
    TensorMeta,
    decode_meta,
    decode_spec,
    encode_meta,
    encode_spec,
)

__all__ = [
    "HEAD_WORDS",
    "MARK",
    "SENTINEL",
    "expecting",
    "first_tensor",
    "header",
    "is_marker",
    "marker",
    "read_header",
]

MAGIC = 0x5C4EDCC0
#: int64 words a receive without a basis posts for the first part of a header.
HEAD_WORDS = 64
#: The last 8 bytes of a first buffer before data arrives, and of a marker.
SENTINEL = torch.tensor(list(b"schedcc\x00"), dtype=torch.uint8)
MARK = torch.tensor(list(b"changed\x01"), dtype=torch.uint8)


def header(number: int, message: Message) -> torch.Tensor:
    """The header of message `number` (CPU, int64)."""
    spec = encode_spec(message.spec)
    meta = encode_meta(message.meta)
    prefix = torch.tensor([MAGIC, number, spec.numel()], dtype=torch.int64)
    return torch.cat([prefix, spec, meta])


def read_header(words: torch.Tensor, number: int) -> tuple[Spec, tuple[TensorMeta, ...]]:
    """The spec and meta of a header, which must be message `number`'s.

    Raises:
        ValueError: not a header, or another message's.
    """
    values = words.tolist()
    if len(values) < 3 or values[0] != MAGIC:
        raise ValueError("what came is not a message header")
    if values[1] != number:
        raise ValueError(f"the header is message {values[1]}'s, not message {number}'s")
    length = values[2]
    try:
        spec = decode_spec(words[3 : 3 + length])
        meta = decode_meta(words[3 + length :])
    except (StopIteration, IndexError, ValueError) as exc:
        raise ValueError(f"the header does not decode ({exc!r})") from None
    return spec, meta


def expecting(meta: TensorMeta, device: torch.device) -> torch.Tensor:
    """A flat uint8 buffer for a tensor of `meta`, 8 bytes longer, ending in `SENTINEL`."""
    nbytes = _nbytes(meta)
    buffer = torch.empty(nbytes + 8, dtype=torch.uint8, device=device)
    buffer[nbytes:] = SENTINEL
    return buffer


def marker(meta: TensorMeta, device: torch.device) -> torch.Tensor:
    """What a changed message sends in place of a tensor of `meta` (see the note)."""
    nbytes = _nbytes(meta)
    buffer = torch.zeros(nbytes + 8, dtype=torch.uint8, device=device)
    buffer[nbytes:] = MARK
    return buffer


def is_marker(buffer: torch.Tensor) -> bool:
    """Whether a buffer from `expecting` received a marker rather than data."""
    tail = buffer[-8:]
    return not torch.equal(tail if tail.device.type == "cpu" else tail.cpu(), SENTINEL)


def first_tensor(buffer: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The tensor of `meta` at the start of a buffer from `expecting`."""
    return buffer[: _nbytes(meta)].view(meta.dtype).view(meta.shape)


def _nbytes(meta: TensorMeta) -> int:
    count = 1
    for size in meta.shape:
        count *= size
    return count * meta.dtype.itemsize
