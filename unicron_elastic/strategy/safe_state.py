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
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

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
    layout, offset = [], 0
    for chunk in chunks:
        layout.append([offset, chunk.nbytes])
        offset = _aligned(offset + chunk.nbytes)
    try:
        header = json.dumps({"tree": encoded.tree, "buffers": layout}, allow_nan=False,
                            separators=(",", ":")).encode()
    except (ValueError, RecursionError) as exc:
        raise StateEncodingError(f"the state cannot be written as JSON: {exc}") from exc
    head = MAGIC + struct.pack("<Q", len(header)) + header
    parts: list[Buffer] = [head, bytes(_aligned(len(head)) - len(head))]
    written = 0
    for chunk, (start, size) in zip(chunks, layout):
        parts.append(bytes(start - written))
        parts.append(chunk)
        written = start + size
    return parts


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
        raise StateDecodingError(f"not a unicron state document ({_looks_like(view)}); refused")
    (length,) = struct.unpack_from("<Q", view, len(MAGIC))
    if length > len(view) - _PREFIX:
        raise StateDecodingError(f"truncated unicron state document: header of {length} bytes, "
                                 f"{len(view) - _PREFIX} present")
    try:
        doc = json.loads(bytes(view[_PREFIX : _PREFIX + length]), parse_constant=_no_constant)
        if not isinstance(doc, dict) or set(doc) != {"tree", "buffers"} or not isinstance(doc["buffers"], list):
            raise StateDecodingError("the header is not {'tree': ..., 'buffers': [...]}")
        return _Decoder(view, _aligned(_PREFIX + length), doc["buffers"]).node(doc["tree"], "state")
    except StateDecodingError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError, OverflowError,
            RuntimeError, binascii.Error) as exc:
        raise StateDecodingError(f"malformed unicron state document: {type(exc).__name__}: {exc}") from None


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


def _looks_like(view: memoryview) -> str:
    head = bytes(view[:4])
    if head[:1] == b"\x80":
        return "it looks like a pickle: loading it could run code"
    if head == b"PK\x03\x04":
        return "it looks like a torch.save zip archive, whose data.pkl is a pickle: loading it could run code"
    return f"{len(view)} bytes starting {head!r}"


class _Decoder:
    def __init__(self, view: memoryview, base: int, layout: list[Any]) -> None:
        self.view, self.base, self.layout = view, base, layout

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

    def chunk(self, obj: dict[str, Any], itemsize: int, path: str) -> tuple[list[int], int, int]:
        """The shape, offset and byte count of the buffer ``obj`` refers to, checked against the document."""
        shape, index = self.ints(obj["shape"], path), obj["i"]
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
        return shape, self.base + offset, nbytes

    def tensor(self, obj: dict[str, Any], path: str) -> torch.Tensor:
        dtype = TORCH_DTYPES.get(obj["dtype"]) if isinstance(obj["dtype"], str) else None
        if dtype is None:
            raise StateDecodingError(f"{path}: unsupported tensor dtype {obj['dtype']!r}")
        shape, start, nbytes = self.chunk(obj, dtype.itemsize, path)
        if nbytes == 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            raw = torch.from_numpy(np.frombuffer(self.view, dtype=np.uint8, count=nbytes, offset=start).copy())
            tensor = (raw.ne(0) if dtype == torch.bool else raw.view(dtype)).reshape(shape)
        if obj.get("param") is True:
            return torch.nn.Parameter(tensor, requires_grad=obj.get("grad") is True)
        return tensor.requires_grad_() if obj.get("grad") is True else tensor

    def array(self, obj: dict[str, Any], path: str) -> np.ndarray | np.generic:
        if not (isinstance(obj["dtype"], str) and _NUMPY_DTYPE.fullmatch(obj["dtype"])):
            raise StateDecodingError(f"{path}: unsupported numpy dtype {obj['dtype']!r}")
        dtype = np.dtype(obj["dtype"])
        shape, start, nbytes = self.chunk(obj, dtype.itemsize, path)
        if nbytes == 0:
            array = np.empty(shape, dtype=dtype)
        elif dtype.kind == "b":
            array = np.frombuffer(self.view, dtype=np.uint8, count=nbytes, offset=start).astype(dtype).reshape(shape)
        else:
            array = np.frombuffer(self.view, dtype=dtype, count=math.prod(shape), offset=start).reshape(shape).copy()
        if obj.get("scalar") is True:
            if shape:
                raise StateDecodingError(f"{path}: a numpy scalar must have shape []")
            return array[()]
        return array
