"""Boundary values: what crosses a stage, what a batch holds, and how a segment is called.

Longer than the project's ~400-line habit on purpose: the value vocabulary and its wire
encoding are one format, and a change to one is a change to the other.

A *value* is any nesting of tuple, list and dict of tensors (any dtype) and constants (None,
bool, int, float, str, torch.Size). Any other `Mapping` (a tokenizer's `BatchEncoding`) is read
as a dict and rebuilt as one; a dataclass instance (a Hugging Face `ModelOutput`) is rebuilt as
its own class from its `__init__` fields. A transport moves a value as a flat list of tensors
plus two small descriptions: the *spec* (the nesting and the constants, hashable and picklable)
and the *meta* (dtype, shape and whether it takes a gradient, per tensor). Both encode to 1-D
int64 tensors, so gloo and NCCL can send them (a dataclass by its class's name, found among the
modules the receiver has imported).

    >>> import torch
    >>> value = (torch.ones(4, 3), {"mask": torch.zeros(4, dtype=torch.bool), "n": 3})
    >>> tensors, spec = flatten(value)
    >>> len(tensors), decode_spec(encode_spec(spec)) == spec
    (2, True)
    >>> meta = tensor_meta(tensors)
    >>> decode_meta(encode_meta(meta)) == meta
    True
    >>> [t.shape[0] for t in flatten(split(value, 2)[1])[0]]
    [2, 2]

[Note: a header only when it changes] A channel's messages usually repeat their spec and meta.
A transport keeps the last `(spec, meta)` it sent or received per channel and sends the encoded
header only when `(spec, meta) != last` (plain equality); the receiver then allocates with
`empty_tensors(meta)` and rebuilds the value with `unflatten`. The meta marks the tensors that
travel a gradient back (`TensorMeta.requires_grad`, the same rule as `grad_tensors`), so both
sides of a channel agree on which gradients are sent, in which order.
"""

from __future__ import annotations

import dataclasses
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from schedcc.errors import ScheduleConfigError

__all__ = [
    "Spec",
    "TensorMeta",
    "call",
    "concat",
    "decode_meta",
    "decode_spec",
    "empty_tensors",
    "encode_meta",
    "encode_spec",
    "flatten",
    "grad_tensors",
    "split",
    "tensor_meta",
    "unflatten",
]

#: A value's structure: nested tagged tuples (see `_TAGS`), hashable and picklable.
Spec = tuple

# One integer tag per kind, used both in specs and in their encoding.
_TENSOR, _NONE, _BOOL, _INT, _FLOAT, _STR, _SIZE, _TUPLE, _LIST, _DICT, _OBJECT = range(11)
_TAGS = {tuple: _TUPLE, list: _LIST, dict: _DICT}
_INT64 = (-(2**63), 2**63 - 1)

# Stable dtype codes: the position in this list (names a torch build lacks keep their place).
_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
    "int64", "int32", "int16", "int8", "uint8", "bool",
    "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
_DTYPES = [getattr(torch, name, None) for name in _DTYPE_NAMES]
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES) if dtype is not None}


# -- calling convention ---------------------------------------------------------------------------


def call(segment: Callable[..., Any], value: Any) -> Any:
    """Call `segment` on `value`: a tuple as positional arguments, a dict (or any `Mapping`, such
    as a tokenizer's `BatchEncoding`) as keyword arguments, anything else (a tensor, a list, a
    constant, a dataclass: a `ModelOutput` too, though it is a Mapping) as the one argument.

    The first segment receives a batch's inputs this way, every later one what its predecessor
    returned.

    >>> call(lambda a, b: a - b, (5, 3)), call(lambda a, b: a - b, {"b": 5, "a": 3})
    (2, -2)
    >>> call(len, [1, 2, 3])
    3
    """
    if type(value) is tuple:
        return segment(*value)
    if isinstance(value, Mapping) and not dataclasses.is_dataclass(value):  # a ModelOutput is both
        bad = [key for key in value if not isinstance(key, str)]
        if bad:
            raise ScheduleConfigError(
                f"a dict passed to a segment becomes keyword arguments, so its keys must be "
                f"strings; got {bad[0]!r}"
            )
        return segment(**value)
    return segment(value)


# -- flatten / unflatten --------------------------------------------------------------------------


def flatten(value: Any, *, name: str = "value") -> tuple[list[torch.Tensor], Spec]:
    """`value`'s tensors in depth-first order and its spec; `unflatten` is the inverse.

    Raises:
        ScheduleConfigError: something that is not a tensor, a constant, or a tuple, list, dict
            (any Mapping) or dataclass of them (or an int outside int64, or a dict key that is
            not a constant), named by its path from `name`.

    >>> import torch
    >>> tensors, spec = flatten({"x": torch.zeros(2), "k": [1, None]})
    >>> unflatten([torch.ones(2)], spec)
    {'x': tensor([1., 1.]), 'k': [1, None]}
    """
    tensors: list[torch.Tensor] = []
    return tensors, _flatten(value, tensors, (name,))


def _tensor_paths(value: Any, name: str) -> list[str]:
    """The path of each tensor of `value` from `name`, in flatten order (for messages)."""
    paths: list[str] = []
    _flatten(value, [], (name,), paths)
    return paths


def _flatten(value: Any, tensors: list, path: tuple, paths: list | None = None) -> Spec:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        if paths is not None:
            paths.append(_path(path))
        return (_TENSOR,)
    kind = type(value)
    tag = _TAGS.get(kind)
    if tag is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _flatten_object(value, tensors, path, paths)
    if tag is None and isinstance(value, Mapping):
        tag = _DICT
    if tag == _DICT:
        items = []
        for key, item in value.items():
            key_spec = _constant(key)
            if key_spec is None or key_spec[0] == _SIZE:
                raise ScheduleConfigError(
                    f"{_path(path)} has the key {key!r}: dict keys in a boundary value must be "
                    "str, int, float, bool or None"
                )
            items.append((key_spec, _flatten(item, tensors, (*path, key), paths)))
        return (tag, tuple(items))
    if tag is not None:
        items = [_flatten(v, tensors, (*path, i), paths) for i, v in enumerate(value)]
        return (tag, tuple(items))
    spec = _constant(value)
    if spec is None:
        raise ScheduleConfigError(
            f"{_path(path)} is a {kind.__name__}: a boundary value is a tensor, None, bool, int, "
            "float, str, torch.Size, or a tuple, list, dict (any Mapping) or dataclass of them"
        )
    if spec[0] == _INT and not _INT64[0] <= value <= _INT64[1]:
        raise ScheduleConfigError(f"{_path(path)} = {value} does not fit in int64")
    return spec


def _flatten_object(value: Any, tensors: list, path: tuple, paths: list | None) -> Spec:
    """A dataclass's spec: its class, its `__init__` fields' names and their specs."""
    names = tuple(field.name for field in dataclasses.fields(value) if field.init)
    items = tuple(_flatten(getattr(value, n), tensors, (*path, n), paths) for n in names)
    return (_OBJECT, type(value), names, items)


def _constant(value: Any) -> Spec | None:
    """The spec of a constant (types kept exact: True, 1 and 1.0 differ), or None."""
    kind = type(value)
    if value is None:
        return (_NONE,)
    if kind is bool:
        return (_BOOL, value)
    if kind is int:
        return (_INT, value)
    if kind is float:
        return (_FLOAT, value.hex())  # nan == nan and -0.0 != 0.0, as bits
    if kind is str:
        return (_STR, value)
    if kind is torch.Size:
        return (_SIZE, tuple(value))
    return None


def unflatten(tensors: Sequence[torch.Tensor], spec: Spec) -> Any:
    """The value that `flatten` described by `spec`, with `tensors` in its tensor places.

    Raises:
        ValueError: the number of tensors is not the number of places in `spec`.
    """
    stream = iter(tensors)
    value = _unflatten(stream, spec)
    if next(stream, None) is not None:
        raise ValueError("more tensors than the spec has places for")
    return value


def _unflatten(stream: Iterator[torch.Tensor], spec: Spec) -> Any:
    tag = spec[0]
    if tag == _TENSOR:
        tensor = next(stream, None)
        if tensor is None:
            raise ValueError("fewer tensors than the spec has places for")
        return tensor
    if tag == _TUPLE:
        return tuple(_unflatten(stream, item) for item in spec[1])
    if tag == _LIST:
        return [_unflatten(stream, item) for item in spec[1]]
    if tag == _DICT:
        return {_constant_value(key): _unflatten(stream, item) for key, item in spec[1]}
    if tag == _OBJECT:
        _, cls, names, items = spec
        return cls(**{name: _unflatten(stream, item) for name, item in zip(names, items)})
    return _constant_value(spec)


def _constant_value(spec: Spec) -> Any:
    tag = spec[0]
    if tag == _NONE:
        return None
    if tag == _FLOAT:
        return float.fromhex(spec[1])
    if tag == _SIZE:
        return torch.Size(spec[1])
    return spec[1]


def _path(path: Sequence[Any]) -> str:
    """`("inputs", 1, "mask")` -> `inputs[1]['mask']`."""
    return str(path[0]) + "".join(f"[{key!r}]" for key in path[1:])


# -- meta and the wire encoding -------------------------------------------------------------------


class TensorMeta(NamedTuple):
    """What a receiver needs to allocate one tensor, and whether it sends a gradient back."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


def grad_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors that travel a gradient back: floating point and requiring grad, in order.

    >>> import torch
    >>> x = torch.ones(2, requires_grad=True)
    >>> len(grad_tensors([x * 2, torch.ones(2), torch.ones(2, dtype=torch.long)]))
    1
    """
    return [t for t in tensors if t.requires_grad and t.is_floating_point()]


def tensor_meta(tensors: Sequence[torch.Tensor]) -> tuple[TensorMeta, ...]:
    """The meta of each tensor (`requires_grad` by the rule of `grad_tensors`)."""
    return tuple(
        TensorMeta(t.dtype, tuple(t.shape), t.requires_grad and t.is_floating_point())
        for t in tensors
    )


def shapes_of(value: Any) -> tuple[Spec, tuple[TensorMeta, ...]]:
    """A value's spec and meta (hashable): what its shapes, dtypes and nesting are.

    >>> import torch
    >>> shapes_of(torch.ones(2, 3)) == shapes_of(torch.zeros(2, 3))
    True
    """
    tensors, spec = flatten(value)
    return spec, tensor_meta(tensors)


def empty_tensors(meta: Sequence[TensorMeta], *, device: Any = None) -> list[torch.Tensor]:
    """Uninitialised receive buffers for `meta` (no grad flag set: the receiver sets it)."""
    return [torch.empty(m.shape, dtype=m.dtype, device=device) for m in meta]


def encode_meta(meta: Sequence[TensorMeta]) -> torch.Tensor:
    """`meta` as a 1-D int64 tensor: count, then per tensor dtype code, grad flag, rank, shape.

    Raises:
        ScheduleConfigError: a dtype schedcc cannot send.
    """
    words = [len(meta)]
    for m in meta:
        code = _DTYPE_CODES.get(m.dtype)
        if code is None:
            raise ScheduleConfigError(f"tensors of dtype {m.dtype} cannot cross a stage")
        words += [code, int(m.requires_grad), len(m.shape), *m.shape]
    return torch.tensor(words, dtype=torch.int64)


def decode_meta(words: torch.Tensor) -> tuple[TensorMeta, ...]:
    """The inverse of `encode_meta`."""
    stream = iter(words.tolist())
    meta = []
    for _ in range(next(stream)):
        dtype, requires_grad, rank = _DTYPES[next(stream)], bool(next(stream)), next(stream)
        meta.append(TensorMeta(dtype, tuple(next(stream) for _ in range(rank)), requires_grad))
    return tuple(meta)


def encode_spec(spec: Spec) -> torch.Tensor:
    """`spec` as a 1-D int64 tensor (a tag stream; no pickle, so a peer cannot run code)."""
    words: list[int] = []
    _encode(spec, words)
    return torch.tensor(words, dtype=torch.int64)


def _encode(spec: Spec, words: list[int]) -> None:
    tag = spec[0]
    if tag == _OBJECT:  # the class by name, its fields as a dict of them
        _, cls, names, items = spec
        words.append(tag)
        _encode((_STR, f"{cls.__module__}:{cls.__qualname__}"), words)
        _encode((_DICT, tuple(((_STR, n), item) for n, item in zip(names, items))), words)
        return
    words.append(tag)
    if tag in (_BOOL, _INT):
        words.append(int(spec[1]))
    elif tag == _FLOAT:
        words.append(struct.unpack("<q", struct.pack("<d", float.fromhex(spec[1])))[0])
    elif tag == _STR:
        data = spec[1].encode()
        padded = data + b"\0" * (-len(data) % 8)
        words.append(len(data))
        for start in range(0, len(padded), 8):
            words.append(int.from_bytes(padded[start : start + 8], "little", signed=True))
    elif tag == _SIZE:
        words += [len(spec[1]), *spec[1]]
    elif tag in (_TUPLE, _LIST, _DICT):
        words.append(len(spec[1]))
        for item in spec[1]:
            if tag == _DICT:
                _encode(item[0], words)
                _encode(item[1], words)
            else:
                _encode(item, words)


def decode_spec(words: torch.Tensor) -> Spec:
    """The inverse of `encode_spec`."""
    return _decode(iter(words.tolist()))


def _decode(stream: Iterator[int]) -> Spec:
    tag = next(stream)
    if tag in (_TENSOR, _NONE):
        return (tag,)
    if tag == _BOOL:
        return (tag, bool(next(stream)))
    if tag == _INT:
        return (tag, next(stream))
    if tag == _FLOAT:
        return (tag, struct.unpack("<d", struct.pack("<q", next(stream)))[0].hex())
    if tag == _STR:
        size = next(stream)
        chunks = [next(stream).to_bytes(8, "little", signed=True) for _ in range(-(-size // 8))]
        return (tag, b"".join(chunks)[:size].decode())
    if tag == _SIZE:
        return (tag, tuple(next(stream) for _ in range(next(stream))))
    if tag == _OBJECT:
        cls = _dataclass_named(_decode(stream)[1])
        fields = _decode(stream)[1]
        return (tag, cls, tuple(key[1] for key, _ in fields), tuple(item for _, item in fields))
    count = next(stream)
    if tag == _DICT:
        return (tag, tuple((_decode(stream), _decode(stream)) for _ in range(count)))
    return (tag, tuple(_decode(stream) for _ in range(count)))


def _dataclass_named(name: str) -> type:
    """The dataclass `module:qualname` names, from a module already imported (decoding never
    imports, so a peer's message runs no code)."""
    module_name, _, qualname = name.partition(":")
    value: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        value = getattr(value, part, None)
    if not (isinstance(value, type) and dataclasses.is_dataclass(value)):
        raise ScheduleConfigError(
            f"a boundary value holds a {name}, which is not a dataclass of an imported module "
            "on this rank; import its module before the run"
        )
    return value


# -- microbatches ---------------------------------------------------------------------------------


def split(
    value: Any,
    num_microbatches: int,
    *,
    name: str = "inputs",
    sizes: Sequence[int] | None = None,
) -> list[Any]:
    """`value` cut into `num_microbatches` equal values along dim 0 of every tensor (or into
    pieces of `sizes` rows each, which `backends.batches.check_sizes` checked).

    Constants are repeated in every microbatch; the pieces are views of the batch's tensors.

    Raises:
        ScheduleConfigError: a tensor without dim 0 or whose dim 0 is not the batch size (dim 0
            of the first tensor), named by its path from `name`; a batch size that
            `num_microbatches` does not divide.

    >>> import torch
    >>> [mb[0].tolist() for mb in split((torch.arange(4), "tag"), 2)]
    [[0, 1], [2, 3]]
    >>> split((torch.ones(4), {"mask": torch.ones(3)}), 2)
    Traceback (most recent call last):
    ...
    schedcc.errors.ScheduleConfigError: inputs[1]['mask'] has 3 rows along dim 0 but the batch \
has 4 (inputs[0]): every tensor of a batch is split into microbatches along dim 0
    """
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise ScheduleConfigError(f"num_microbatches must be an int, got {num_microbatches!r}")
    if num_microbatches < 1:
        raise ScheduleConfigError(f"num_microbatches must be >= 1, got {num_microbatches}")
    tensors, spec = flatten(value, name=name)
    if not tensors:
        return [unflatten([], spec) for _ in range(num_microbatches)]
    for index, tensor in enumerate(tensors):
        if tensor.dim() == 0 or tensor.shape[0] != tensors[0].shape[0]:
            raise ScheduleConfigError(_bad_rows(_tensor_paths(value, name), index, tensors))
    batch_size = tensors[0].shape[0]
    size, rest = divmod(batch_size, num_microbatches)
    if sizes is None and (rest or size == 0):
        raise ScheduleConfigError(
            f"{name} has a batch of {batch_size}, which does not split into {num_microbatches} "
            f"equal microbatches; use a batch size that is a multiple of {num_microbatches}"
        )
    pieces = [tensor.split(size if sizes is None else list(sizes)) for tensor in tensors]
    return [unflatten([p[i] for p in pieces], spec) for i in range(num_microbatches)]


def _bad_rows(paths: list[str], index: int, tensors: list[torch.Tensor]) -> str:
    tensor = tensors[index]
    rule = "every tensor of a batch is split into microbatches along dim 0"
    if tensor.dim() == 0:
        return f"{paths[index]} is a 0-dim tensor: {rule}"
    return (
        f"{paths[index]} has {tensor.shape[0]} rows along dim 0 but the batch has "
        f"{tensors[0].shape[0]} ({paths[0]}): {rule}"
    )


def concat(values: Sequence[Any], *, name: str = "outputs") -> Any:
    """The inverse of `split`: one value whose tensors are the microbatches' joined on dim 0.

    Raises:
        ScheduleConfigError: the values differ in structure or constants, or a tensor has no
            dim 0 or differs beyond dim 0, named by its path from `name`.

    >>> import torch
    >>> concat([{"y": torch.zeros(1)}, {"y": torch.ones(2)}])
    {'y': tensor([0., 1., 1.])}
    """
    if not values:
        raise ScheduleConfigError("concat needs at least one value")
    flat = [flatten(value, name=name) for value in values]
    spec = flat[0][1]
    for index, (_, other) in enumerate(flat):
        if other != spec:
            raise ScheduleConfigError(
                f"{name} of microbatch {index} differs from microbatch 0's in structure or "
                f"constants ({_first_difference(spec, other, (name,))}); cannot join them"
            )
    joined = []
    for place, path in enumerate(_tensor_paths(values[0], name)):
        pieces = [tensors[place] for tensors, _ in flat]
        if any(p.dim() == 0 or p.shape[1:] != pieces[0].shape[1:] for p in pieces):
            shapes = ", ".join(str(tuple(p.shape)) for p in pieces)
            raise ScheduleConfigError(
                f"cannot join {path} along dim 0: the microbatches' shapes are {shapes}"
            )
        joined.append(torch.cat(pieces))
    return unflatten(joined, spec)


def _first_difference(a: Spec, b: Spec, path: tuple) -> str:
    """Where two specs first differ, as `path: a vs b`."""
    if a[0] == b[0] and a[0] in (_TUPLE, _LIST, _DICT) and len(a[1]) == len(b[1]):
        for index, (x, y) in enumerate(zip(a[1], b[1])):
            if a[0] == _DICT:
                key, other_key = _constant_value(x[0]), _constant_value(y[0])
                if key != other_key:
                    return f"{_path(path)}: key {key!r} vs {other_key!r}"
                if x[1] != y[1]:
                    return _first_difference(x[1], y[1], (*path, key))
            elif x != y:
                return _first_difference(x, y, (*path, index))
    return f"{_path(path)}: {_describe(a)} vs {_describe(b)}"


def _describe(spec: Spec) -> str:
    tag = spec[0]
    if tag == _TENSOR:
        return "a tensor"
    if tag == _OBJECT:
        return f"a {spec[1].__name__}"
    if tag in (_TUPLE, _LIST, _DICT):
        return f"a {('tuple', 'list', 'dict')[tag - _TUPLE]} of {len(spec[1])}"
    return repr(_constant_value(spec))
