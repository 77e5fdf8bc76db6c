"""Training state as raw tensor bytes plus a JSON skeleton: written and read without pickle.

Snapshots in the agent's store, state handed from a replica to a joiner, and
disk checkpoints all travel in this format, so loading one never runs code,
whoever wrote the bytes (the agent's TCPStore has no authentication).

A document is::

    MAGIC (16 bytes) | header length (u64, little-endian) | header (JSON, UTF-8)
    | zero padding to 64 bytes | buffers, each at a 64-byte-aligned offset

The header is ``{"tree": ..., "buffers": [[offset, nbytes], ...]}``; offsets
count from the first byte after the padding. ``tree`` is the state with every
value JSON cannot hold exactly replaced by a tagged object ``{"$t": tag, ...}``:

=========== ==========================================================
``float``    a non-finite float (``"nan"``, ``"inf"``, ``"-inf"``)
``tuple``    a tuple; ``size`` a ``torch.Size``
``map``      a dict with a key that is not a string (or is ``"$t"``)
``odict``    an ``OrderedDict`` (a ``state_dict``), with its ``_metadata``
``tensor``   a dense tensor or ``nn.Parameter``: dtype, shape, buffer index
``ndarray``  a numpy array or numpy scalar of a numeric dtype
``dtype``,   a ``torch.dtype`` / ``torch.device`` by name;
``device``
``bytes``    bytes, base64
=========== ==========================================================

Anything else (enums, arbitrary objects, object arrays, sparse tensors) is
refused when the state is *encoded*, with the path of the value, rather than
being pickled. Tensors come back on the CPU, each with its own memory;
tensors that shared storage no longer do. Pure: no I/O.

The pieces serve other carriers of the same skeleton too
(:mod:`~unicron_elastic.strategy.engine.state_transfer` broadcasts the skeleton and
then each array on its own): :func:`encode` splits a state, :func:`dump_json` /
:func:`load_json` write and read a skeleton as strictly as documents do,
:func:`tensor_dtype` / :func:`array_dtype` check a dtype against the
allow-list, and :func:`decode` rebuilds the state from a skeleton and its arrays.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from unicron_elastic.api import StateDecodingError, StateEncodingError

Buffer = bytes | bytearray | memoryview  # anything with the buffer protocol (a numpy array too)

MAGIC = b"UNICRON-STATE\x00v1"
TAG = "$t"
_ALIGN = 64
_PREFIX = len(MAGIC) + 8
_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "complex128", "complex64", "int64", "int32", "int16",
                "int8", "uint64", "uint32", "uint16", "uint8", "bool", "float8_e4m3fn", "float8_e4m3fnuz",
                "float8_e5m2", "float8_e5m2fnuz")
TORCH_DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}
_NUMPY_DTYPE = re.compile(r"[<>|=][biufc]\d{1,2}")
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_T = TypeVar("_T")
CARRIED = ("None, bool, int, float, str, bytes, list, tuple, dict, OrderedDict, torch.Size, torch.dtype, "
           "torch.device, dense tensors and numeric numpy arrays/scalars")


@dataclass(frozen=True)
class EncodedState:
    """A state split into a JSON-ready skeleton and the arrays it refers to.

    Attributes:
        tree: The skeleton (only JSON types; tagged objects for the rest).
        buffers: The tensors and numpy arrays, in the order the skeleton indexes them.
    """

    tree: Any
    buffers: list[torch.Tensor | np.ndarray]


def encode(state: Any, copy: bool = False) -> EncodedState:
    """Split ``state`` into a skeleton and its arrays.

    Args:
        state: The state (nested dicts, lists, tuples, scalars, tensors, numpy arrays).
        copy: Copy every tensor (to the CPU) and array now, so later changes to
            ``state`` do not reach what :func:`pack` writes (a background writer).

    Returns:
        The encoded state.

    Raises:
        StateEncodingError: A value has a type the format does not carry; the
            message names its path, e.g. ``state['hyper_parameters']['mode']``.
    """
    return _Encoder(copy).encode(state)


def pack(encoded: EncodedState) -> bytes:
    """The document bytes of an encoded state.

    Raises:
        StateEncodingError: The skeleton cannot be written as JSON (e.g. an
            integer with more digits than Python converts).
    """
    return b"".join(pack_parts(encoded))


def pack_parts(encoded: EncodedState) -> list[Buffer]:
    """The document as consecutive pieces (views of the arrays, not copies): to write to a file.

    Raises:
        StateEncodingError: See :func:`pack`.
    """
    chunks = [_raw(b) for b in encoded.buffers]
    doc_layout = layout(encoded)
    parts: list[Buffer] = [doc_layout.head, bytes(doc_layout.body - len(doc_layout.head))]
    written = 0
    for chunk, (start, size) in zip(chunks, doc_layout.buffers):
        parts.append(bytes(start - written))
        parts.append(chunk)
        written = start + size
    return parts


@dataclass(frozen=True)
class Layout:
    """Where everything of a document goes, before any array is copied.

    Attributes:
        head: The document's first bytes (magic, header length, header).
        body: Offset of the first array's byte (``head`` padded to 64 bytes).
        buffers: ``[offset, nbytes]`` of each array, counted from ``body``.
        size: The whole document's size in bytes.
    """

    head: bytes
    body: int
    buffers: list[list[int]]
    size: int


def layout(encoded: EncodedState) -> Layout:
    """Where :func:`pack` puts each part of ``encoded``: a writer copies the arrays straight to their places.

    Raises:
        StateEncodingError: See :func:`pack`.
    """
    buffers, offset = [], 0
    for buffer in encoded.buffers:
        nbytes = buffer.nbytes if isinstance(buffer, np.ndarray) else buffer.numel() * buffer.element_size()
        buffers.append([offset, nbytes])
        offset = _aligned(offset + nbytes)
    header = dump_json({"tree": encoded.tree, "buffers": buffers})
    head = MAGIC + struct.pack("<Q", len(header)) + header
    end = buffers[-1][0] + buffers[-1][1] if buffers else 0
    return Layout(head, _aligned(len(head)), buffers, _aligned(len(head)) + end)


def dumps(state: Any) -> bytes:
    """``pack(encode(state))``.

    Raises:
        StateEncodingError: See :func:`encode`.
    """
    return pack(encode(state))


def loads(data: Buffer) -> Any:
    """The state in a document written by :func:`dumps`; nothing in ``data`` is executed.

    Raises:
        StateDecodingError: ``data`` is not such a document (a pickle or
            ``torch.save`` file, truncated, malformed or inconsistent).
    """
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX or bytes(view[: len(MAGIC)]) != MAGIC:
        raise StateDecodingError(f"not a unicron state document ({looks_like(view)}); refused")
    (length,) = struct.unpack_from("<Q", view, len(MAGIC))
    if length > len(view) - _PREFIX:
        raise StateDecodingError(f"truncated unicron state document: header of {length} bytes, "
                                 f"{len(view) - _PREFIX} present")
    doc = load_json(view[_PREFIX : _PREFIX + length])
    if not isinstance(doc, dict) or set(doc) != {"tree", "buffers"} or not isinstance(doc["buffers"], list):
        raise StateDecodingError("the header is not {'tree': ..., 'buffers': [...]}")
    decoder = _DocumentDecoder(view, _aligned(_PREFIX + length), doc["buffers"])
    return _decoding(lambda: decoder.node(doc["tree"], "state"))


def decode(tree: Any, buffers: Sequence[torch.Tensor | np.ndarray]) -> Any:
    """The state a skeleton describes, with its tensors and arrays taken from ``buffers``.

    The inverse of :func:`encode` for carriers that move the skeleton and the
    arrays separately. Each buffer must be a tensor (numpy array) of exactly
    the dtype and shape the skeleton gives it, and may be referred to once; it
    is used as it is, not copied (a tensor marked as a parameter is wrapped in
    one, sharing its memory). Whoever filled a ``bool`` buffer from raw bytes
    must make every byte 0 or 1 first.

    Args:
        tree: The skeleton (:attr:`EncodedState.tree`), as read by :func:`load_json`.
        buffers: The arrays, in the order the skeleton indexes them.

    Returns:
        The state.

    Raises:
        StateDecodingError: The skeleton is malformed (unknown tags, dtypes
            outside the allow-list, bad shapes) or does not match ``buffers``.
    """
    decoder = _BufferDecoder(buffers)
    return _decoding(lambda: decoder.node(tree, "state"))


def dump_json(doc: Any) -> bytes:
    """``doc`` (a skeleton, or a header holding one) as compact UTF-8 JSON, refusing bare NaN/Infinity.

    Raises:
        StateEncodingError: ``doc`` cannot be written as JSON (e.g. an integer
            with more digits than Python converts, or nesting too deep).
    """
    try:
        return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
    except (ValueError, RecursionError) as exc:
        raise StateEncodingError(f"the state cannot be written as JSON: {exc}") from exc


def load_json(data: Buffer) -> Any:
    """The JSON value in ``data``, read as strictly as a document's header (no bare NaN/Infinity).

    Raises:
        StateDecodingError: ``data`` is not UTF-8 JSON, holds a bare
            non-finite constant, or is nested too deeply.
    """
    return _decoding(lambda: json.loads(bytes(data), parse_constant=_no_constant), what="header")


def tensor_dtype(name: Any, path: str = "state") -> torch.dtype:
    """The torch dtype called ``name`` (e.g. ``"bfloat16"``), if the format carries it.

    Raises:
        StateDecodingError: ``name`` is not one of :data:`TORCH_DTYPES`.
    """
    dtype = TORCH_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise StateDecodingError(f"{path}: unsupported tensor dtype {name!r}"[:300])
    return dtype


def array_dtype(name: Any, path: str = "state") -> np.dtype:
    """The numpy dtype with the string ``name`` (e.g. ``"<f8"``), if numeric.

    Raises:
        StateDecodingError: ``name`` is not a numeric (bool, int, uint, float, complex) numpy dtype string.
    """
    if not (isinstance(name, str) and _NUMPY_DTYPE.fullmatch(name)):
        raise StateDecodingError(f"{path}: unsupported numpy dtype {name!r}"[:300])
    try:
        return np.dtype(name)
    except TypeError as exc:  # e.g. "<f3": the pattern allows sizes numpy lacks
        raise StateDecodingError(f"{path}: unsupported numpy dtype {name!r}: {exc}") from None


def _decoding(step: Callable[[], _T], what: str = "unicron state document") -> _T:
    """``step()``, with any error a malformed input can cause turned into a :class:`StateDecodingError`."""
    try:
        return step()
    except StateDecodingError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError, OverflowError,
            RuntimeError, binascii.Error) as exc:
        raise StateDecodingError(f"malformed {what}: {type(exc).__name__}: {exc}"[:1000]) from None


# -- encoding -----------------------------------------------------------------------------------
class _Encoder:
    def __init__(self, copy: bool) -> None:
        self.copy = copy
        self.buffers: list[torch.Tensor | np.ndarray] = []

    def encode(self, state: Any) -> EncodedState:
        try:
            tree = self.node(state, "state")
        except RecursionError:
            raise StateEncodingError("the state is nested too deeply to encode") from None
        return EncodedState(tree, self.buffers)

    def node(self, obj: Any, path: str) -> Any:  # noqa: C901 - one branch per carried type
        kind = type(obj)
        if obj is None or kind in (bool, int, str):
            return obj
        if kind is float:
            return obj if math.isfinite(obj) else {TAG: "float", "v": repr(obj)}
        if kind is list:
            return [self.node(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if kind is tuple:
            return {TAG: "tuple", "v": [self.node(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if kind is dict:
            if all(type(k) is str for k in obj) and TAG not in obj:
                return {k: self.node(v, f"{path}[{k!r}]") for k, v in obj.items()}
            return {TAG: "map", "v": self.items(obj, path)}
        if kind is OrderedDict:
            encoded = {TAG: "odict", "v": self.items(obj, path)}
            if hasattr(obj, "_metadata"):  # module versions, read by load_state_dict
                encoded["meta"] = self.node(obj._metadata, f"{path}._metadata")
            return encoded
        if kind in (torch.Tensor, torch.nn.Parameter):
            return self.tensor(obj, path)
        if kind is np.ndarray or isinstance(obj, np.generic):
            return self.array(obj, path)
        if kind is torch.Size:
            return {TAG: "size", "v": list(obj)}
        if kind is torch.dtype and str(obj).removeprefix("torch.") in TORCH_DTYPES:
            return {TAG: "dtype", "v": str(obj).removeprefix("torch.")}
        if kind is torch.device:
            return {TAG: "device", "v": str(obj)}
        if kind is bytes:
            return {TAG: "bytes", "v": base64.b64encode(obj).decode()}
        raise _refused(path, obj)

    def items(self, mapping: dict[Any, Any], path: str) -> list[list[Any]]:
        return [[self.node(k, f"{path} (key {k!r})"), self.node(v, f"{path}[{k!r}]")] for k, v in mapping.items()]

    def tensor(self, t: torch.Tensor, path: str) -> dict[str, Any]:
        name = str(t.dtype).removeprefix("torch.")
        if t.layout != torch.strided or t.is_quantized or t.is_meta or t.is_nested or name not in TORCH_DTYPES:
            raise StateEncodingError(f"{path} is a {name} tensor with layout {t.layout} on {t.device}: only dense "
                                     f"tensors of the dtypes {', '.join(TORCH_DTYPES)} can be carried")
        data = t.detach()
        if self.copy:
            data = data.to("cpu", memory_format=torch.contiguous_format, copy=True)
        self.buffers.append(data)
        return {TAG: "tensor", "i": len(self.buffers) - 1, "dtype": name, "shape": list(t.shape),
                "param": type(t) is torch.nn.Parameter, "grad": t.requires_grad}

    def array(self, a: np.ndarray | np.generic, path: str) -> dict[str, Any]:
        dtype = a.dtype
        if not _NUMPY_DTYPE.fullmatch(dtype.str):
            raise StateEncodingError(f"{path} is a numpy {type(a).__name__} of dtype {dtype}: only numeric "
                                     "(bool, int, uint, float, complex) numpy values can be carried")
        scalar = not isinstance(a, np.ndarray)
        data = np.asarray(a)
        self.buffers.append(np.array(data, copy=True, order="C") if self.copy else data)
        return {TAG: "ndarray", "i": len(self.buffers) - 1, "dtype": dtype.str, "shape": list(data.shape),
                "scalar": scalar}


def _refused(path: str, obj: Any) -> StateEncodingError:
    kind = type(obj)
    return StateEncodingError(
        f"{path} is a {kind.__module__}.{kind.__qualname__}: the state is loaded without unpickling, so it may "
        f"hold only {CARRIED}; convert this value to one of those (e.g. an enum to its value)")


def _raw(buffer: torch.Tensor | np.ndarray) -> memoryview:
    """The bytes of an array, C order, without copying when it is already so laid out."""
    if isinstance(buffer, np.ndarray):
        return memoryview(np.ascontiguousarray(buffer).reshape(-1).view(np.uint8))
    flat = buffer.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# -- decoding -----------------------------------------------------------------------------------
def _no_constant(name: str) -> None:
    raise StateDecodingError(f"the header holds the bare JSON constant {name} (non-finite floats are tagged)")


def looks_like(view: memoryview) -> str:
    """What bytes that are not what was expected seem to be, for an error message (a pickle, a torch.save zip)."""
    head = bytes(view[:4])
    if head[:1] == b"\x80":
        return "it looks like a pickle: loading it could run code"
    if head == b"PK\x03\x04":
        return "it looks like a torch.save zip archive, whose data.pkl is a pickle: loading it could run code"
    return f"{len(view)} bytes starting {head!r}"


class _Decoder:
    """Rebuilds a state from its skeleton; subclasses supply the arrays the skeleton refers to."""

    def node(self, obj: Any, path: str) -> Any:
        if isinstance(obj, list):
            return [self.node(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if not isinstance(obj, dict):
            return obj  # None, bool, int, float, str
        if TAG not in obj:
            return {k: self.node(v, f"{path}[{k!r}]") for k, v in obj.items()}
        tag = obj[TAG]
        if tag == "float" and obj.get("v") in _NON_FINITE:
            return _NON_FINITE[obj["v"]]
        if tag == "tuple" and isinstance(obj.get("v"), list):
            return tuple(self.node(obj["v"], path))
        if tag == "size":
            return torch.Size(self.ints(obj["v"], path))
        if tag == "map":
            return dict(self.items(obj["v"], path))
        if tag == "odict":
            result = OrderedDict(self.items(obj["v"], path))
            if "meta" in obj:
                result._metadata = self.node(obj["meta"], f"{path}._metadata")  # type: ignore[attr-defined]
            return result
        if tag == "tensor":
            return self.tensor(obj, path)
        if tag == "ndarray":
            return self.array(obj, path)
        if tag == "dtype" and obj.get("v") in TORCH_DTYPES:
            return TORCH_DTYPES[obj["v"]]
        if tag == "device" and isinstance(obj.get("v"), str):
            return torch.device(obj["v"])
        if tag == "bytes" and isinstance(obj.get("v"), str):
            return base64.b64decode(obj["v"], validate=True)
        raise StateDecodingError(f"{path}: unknown or malformed tagged value {str(obj)[:200]}")

    def items(self, pairs: Any, path: str) -> list[tuple[Any, Any]]:
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise StateDecodingError(f"{path}: a mapping must be a list of [key, value] pairs")
        items = []
        for k, v in pairs:
            key = self.node(k, f"{path} (a key)")
            hash(key)  # a list or dict key could never have been written: TypeError -> refused
            items.append((key, self.node(v, f"{path}[{key!r}]")))
        return items

    @staticmethod
    def ints(values: Any, path: str) -> list[int]:
        if not isinstance(values, list) or not all(type(v) is int and v >= 0 for v in values):
            raise StateDecodingError(f"{path}: a shape must be a list of non-negative integers")
        return values

    def tensor(self, obj: dict[str, Any], path: str) -> torch.Tensor:
        dtype = tensor_dtype(obj["dtype"], path)
        tensor = self.tensor_data(obj["i"], dtype, self.ints(obj["shape"], path), path)
        if obj.get("param") is True:
            return torch.nn.Parameter(tensor, requires_grad=obj.get("grad") is True)
        return tensor.requires_grad_() if obj.get("grad") is True else tensor

    def array(self, obj: dict[str, Any], path: str) -> np.ndarray | np.generic:
        dtype = array_dtype(obj["dtype"], path)
        shape = self.ints(obj["shape"], path)
        array = self.array_data(obj["i"], dtype, shape, path)
        if obj.get("scalar") is True:
            if shape:
                raise StateDecodingError(f"{path}: a numpy scalar must have shape []")
            return array[()]
        return array

    def tensor_data(self, index: Any, dtype: torch.dtype, shape: list[int], path: str) -> torch.Tensor:
        """The tensor of buffer ``index``, of ``dtype`` and ``shape``."""
        raise NotImplementedError

    def array_data(self, index: Any, dtype: np.dtype, shape: list[int], path: str) -> np.ndarray:
        """The numpy array of buffer ``index``, of ``dtype`` and ``shape``."""
        raise NotImplementedError


class _DocumentDecoder(_Decoder):
    """Arrays copied out of a document's bytes (:func:`loads`)."""

    def __init__(self, view: memoryview, base: int, layout: list[Any]) -> None:
        self.view, self.base, self.layout = view, base, layout

    def chunk(self, index: Any, shape: list[int], itemsize: int, path: str) -> tuple[int, int]:
        """The offset and byte count of buffer ``index``, checked against the document."""
        if type(index) is not int or not 0 <= index < len(self.layout):
            raise StateDecodingError(f"{path}: buffer index {index!r} out of range")
        entry = self.layout[index]
        if not (isinstance(entry, list) and len(entry) == 2 and all(type(v) is int and v >= 0 for v in entry)):
            raise StateDecodingError(f"{path}: malformed buffer entry {entry!r}")
        offset, nbytes = entry
        if nbytes != math.prod(shape) * itemsize:
            raise StateDecodingError(f"{path}: {nbytes} bytes do not hold shape {shape} of {itemsize}-byte items")
        if self.base + offset + nbytes > len(self.view):
            raise StateDecodingError(f"{path}: buffer at {offset} (+{nbytes} bytes) lies past the end of the document")
        return self.base + offset, nbytes

    def tensor_data(self, index: Any, dtype: torch.dtype, shape: list[int], path: str) -> torch.Tensor:
        start, nbytes = self.chunk(index, shape, dtype.itemsize, path)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        raw = torch.from_numpy(np.frombuffer(self.view, dtype=np.uint8, count=nbytes, offset=start).copy())
        return (raw.ne(0) if dtype == torch.bool else raw.view(dtype)).reshape(shape)

    def array_data(self, index: Any, dtype: np.dtype, shape: list[int], path: str) -> np.ndarray:
        start, nbytes = self.chunk(index, shape, dtype.itemsize, path)
        if nbytes == 0:
            return np.empty(shape, dtype=dtype)
        if dtype.kind == "b":
            return np.frombuffer(self.view, dtype=np.uint8, count=nbytes, offset=start).astype(dtype).reshape(shape)
        return np.frombuffer(self.view, dtype=dtype, count=math.prod(shape), offset=start).reshape(shape).copy()


class _BufferDecoder(_Decoder):
    """Arrays given as they are (:func:`decode`): checked, not copied, each used once."""

    def __init__(self, buffers: Sequence[torch.Tensor | np.ndarray]) -> None:
        self.buffers = buffers
        self.used: set[int] = set()

    def take(self, index: Any, kind: type, dtype: Any, shape: list[int], path: str) -> Any:
        if type(index) is not int or not 0 <= index < len(self.buffers):
            raise StateDecodingError(f"{path}: buffer index {index!r} out of range")
        if index in self.used:
            raise StateDecodingError(f"{path}: buffer {index} is referred to twice")
        buffer = self.buffers[index]
        if not isinstance(buffer, kind) or buffer.dtype != dtype or list(buffer.shape) != shape:
            has = f"{_kind(buffer)} of dtype {getattr(buffer, 'dtype', None)} and shape " \
                  f"{list(getattr(buffer, 'shape', []))}"
            raise StateDecodingError(f"{path}: buffer {index} is a {has}, not a {_kind(kind)} of dtype {dtype} and "
                                     f"shape {shape}")
        self.used.add(index)
        return buffer

    def tensor_data(self, index: Any, dtype: torch.dtype, shape: list[int], path: str) -> torch.Tensor:
        return self.take(index, torch.Tensor, dtype, shape, path)

    def array_data(self, index: Any, dtype: np.dtype, shape: list[int], path: str) -> np.ndarray:
        return self.take(index, np.ndarray, dtype, shape, path)


def _kind(buffer: Any) -> str:
    kind = buffer if isinstance(buffer, type) else type(buffer)
    return "torch tensor" if issubclass(kind, torch.Tensor) else "numpy array" if issubclass(kind, np.ndarray) \
        else f"{kind.__module__}.{kind.__qualname__}"
