"""A training state broadcast to a process group tensor by tensor, without pickle.

The root encodes its state with :func:`~unicron_elastic.strategy.snapshots.safe_state.encode`
(no copy: the state must not change during the broadcast) and sends, each
message a broadcast from the root:

1. ``int64[1]``: the length ``n`` of the header in bytes; or ``-m`` when the
   root could not encode its state, followed by ``uint8[m]``, the error
   message (UTF-8), and nothing else.
2. ``uint8[n]``: the header, JSON ``{"format": FORMAT, "tree": skeleton,
   "buffers": [[kind, dtype, shape], ...]}``; ``kind`` is ``"tensor"`` (``dtype``
   a torch dtype name, e.g. ``"bfloat16"``) or ``"ndarray"`` (a numpy dtype
   string, e.g. ``"<f8"``).
3. For each buffer holding at least one byte, in order: its bytes in C order.

Receivers check the header (dtypes only from safe_state's allow-list, shapes
non-negative with at most :data:`MAX_DIMS` dimensions, the arrays together at
most ``max_bytes``) before anything more arrives, preallocate every tensor and
array with its dtype and shape, receive each buffer directly into its own
(a ``uint8`` view of it: gloo in torch 2.13 refuses int16, uint16/32/64 and the
float8 dtypes with "Invalid scalar type", and a broadcast copies bytes anyway),
then rebuild the state with :func:`~unicron_elastic.strategy.snapshots.safe_state.decode`:
nothing is unpickled, and the largest message is the largest array or the
header. The root sends contiguous CPU tensors and arrays from their own memory;
others are made contiguous on the CPU one at a time, just before they are sent.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog
import torch
import torch.distributed as dist

from unicron_elastic.api import StateDecodingError, StateEncodingError
from unicron_elastic.strategy.snapshots.safe_state import (array_dtype, decode, dump_json, encode, load_json, looks_like,
                                                 tensor_dtype)

log = structlog.get_logger(__name__)

FORMAT = "unicron-state-stream/1"
MAX_HEADER_BYTES = 256 << 20
MAX_ERROR_BYTES = 4096
MAX_DIMS = 64
Array = torch.Tensor | np.ndarray


def broadcast_state(pg: dist.ProcessGroup, root: int, rank_index: int, state: Any = None, *,
                    max_bytes: int | None = None, max_header_bytes: int = MAX_HEADER_BYTES,
                    device: torch.device = torch.device("cpu"),
                    wait: Callable[[dist.ProcessGroup, Any], None] | None = None) -> Any:
    """Send ``state`` from the member ``root`` of ``pg`` to every other member, array by array.

    Every member of ``pg`` must call this with the same ``root``. Received
    tensors are on the CPU, each with its own memory; parameters come back as
    ``nn.Parameter`` with their ``requires_grad``.

    Args:
        pg: The process group (only its ``broadcast`` is used).
        root: The group rank of the sender.
        rank_index: This member's group rank.
        state: The state to send (root); ignored on the others, which pass None.
        max_bytes: (receivers) Refuse a state whose arrays take more bytes than
            this; default the machine's physical memory.
        max_header_bytes: The largest skeleton the root sends and the receivers accept.
        device: Where ``pg`` takes its tensors (NCCL: the GPU): each array is
            staged there for its broadcast; what is received still lands on the CPU.
        wait: With ``device``: waits for a broadcast before its result is copied back, and raises when it
            failed (:meth:`~unicron_elastic.strategy.engine.transport.CollectiveTransport.wait`; default
            ``work.wait()``).

    Returns:
        On the root, ``state`` itself (not a copy); on the others, the state received.

    Raises:
        StateEncodingError: (root) The state holds a value the format cannot
            carry, or its skeleton is larger than ``max_header_bytes``. The root
            then sends the error instead of a header and nothing else, so the
            receivers raise StateDecodingError at once rather than wait.
        StateDecodingError: (receivers) The root could not encode its state, or
            what arrived is malformed: refused before any array arrives when the
            header is (the root, still sending, then fails at the group's
            timeout), after all of them when only the skeleton is (the root's
            broadcasts complete). Every receiver sees the same bytes and refuses
            alike.
        RuntimeError: The broadcast itself failed (a member left, the group's timeout).
    """
    if device.type != "cpu":
        pg = _Staged(pg, device, wait or (lambda group, work: work.wait()))
    if rank_index == root:
        _send(pg, root, state, max_header_bytes)
        return state
    return _receive(pg, root, _physical_memory() if max_bytes is None else max_bytes, max_header_bytes)


# -- the root ---------------------------------------------------------------------------------------
def _send(pg: dist.ProcessGroup, root: int, state: Any, max_header_bytes: int) -> None:
    try:
        encoded = encode(state)
        header = dump_json({"format": FORMAT, "tree": encoded.tree, "buffers": [_spec(b) for b in encoded.buffers]})
        if len(header) > max_header_bytes:
            raise StateEncodingError(f"the state's skeleton takes {len(header)} bytes, more than the "
                                     f"{max_header_bytes} a receiver accepts")
    except Exception as exc:
        _send_refusal(pg, root, exc)
        raise
    _broadcast(pg, root, torch.tensor([len(header)], dtype=torch.int64))
    _broadcast(pg, root, torch.frombuffer(bytearray(header), dtype=torch.uint8))
    sent = 0
    for buffer in encoded.buffers:
        flat = _bytes_to_send(buffer)
        if flat.numel():
            _broadcast(pg, root, flat)
            sent += flat.numel()
    log.debug("state_sent", header_bytes=len(header), arrays=len(encoded.buffers), array_bytes=sent)


def _send_refusal(pg: dist.ProcessGroup, root: int, exc: Exception) -> None:
    """Tell the receivers why no state comes (best effort: the original error matters more)."""
    message = f"{type(exc).__name__}: {exc}".encode()[:MAX_ERROR_BYTES]
    try:
        _broadcast(pg, root, torch.tensor([-len(message)], dtype=torch.int64))
        _broadcast(pg, root, torch.frombuffer(bytearray(message), dtype=torch.uint8))
    except RuntimeError as send_error:
        log.warning("state_refusal_not_sent", error=str(exc), send_error=str(send_error))


def _spec(buffer: Array) -> list[Any]:
    if isinstance(buffer, np.ndarray):
        return ["ndarray", buffer.dtype.str, list(buffer.shape)]
    return ["tensor", str(buffer.dtype).removeprefix("torch."), list(buffer.shape)]


def _bytes_to_send(buffer: Array) -> torch.Tensor:
    """The bytes of ``buffer`` in C order as a flat ``uint8`` tensor: its own memory when contiguous on the CPU."""
    if isinstance(buffer, np.ndarray):
        array = np.ascontiguousarray(buffer)
        if not array.flags.writeable:  # torch.from_numpy warns about read-only memory
            array = array.copy()
        return torch.from_numpy(array.reshape(-1).view(np.uint8))
    tensor = buffer.detach()
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg().cpu().contiguous()
    return tensor.reshape(-1).view(torch.uint8)


# -- the receivers ----------------------------------------------------------------------------------
def _receive(pg: dist.ProcessGroup, root: int, max_bytes: int, max_header_bytes: int) -> Any:
    length = torch.zeros(1, dtype=torch.int64)
    _broadcast(pg, root, length)
    n = int(length.item())
    if n < 0:
        raise StateDecodingError(f"the sending replica could not send its state: {_refusal(pg, root, -n)}")
    if not 0 < n <= max_header_bytes:
        raise StateDecodingError(f"a state header of {n} bytes announced; refused (at most {max_header_bytes})")
    header = torch.empty(n, dtype=torch.uint8)
    _broadcast(pg, root, header)
    if header[0] != ord("{"):  # e.g. a peer still sending a pickle or a whole document
        raise StateDecodingError(f"the state header is not a JSON object ({looks_like(memoryview(header.numpy()))}); "
                                 "refused")
    tree, buffers = _parse_header(load_json(header.numpy()), max_bytes)
    for buffer in buffers:
        flat = _bytes_to_fill(buffer)
        if flat.numel():
            _broadcast(pg, root, flat)
            if _is_bool(buffer):
                flat.clamp_(max=1)  # a bool byte other than 0 or 1 is undefined behaviour: nonzero is True
    return decode(tree, buffers)


def _refusal(pg: dist.ProcessGroup, root: int, size: int) -> str:
    if size > MAX_ERROR_BYTES:
        raise StateDecodingError(f"a refusal of {size} bytes announced; refused (at most {MAX_ERROR_BYTES})")
    message = torch.empty(size, dtype=torch.uint8)
    if size:
        _broadcast(pg, root, message)
    return bytes(message.numpy()).decode(errors="replace")


def _parse_header(doc: Any, max_bytes: int) -> tuple[Any, list[Array]]:
    """The skeleton and the preallocated arrays a header describes.

    Raises:
        StateDecodingError: The header is malformed, names a dtype outside the
            allow-list, or its arrays would take more than ``max_bytes``.
    """
    if not (isinstance(doc, dict) and set(doc) == {"format", "tree", "buffers"} and doc["format"] == FORMAT
            and isinstance(doc["buffers"], list)):
        raise StateDecodingError(f"the state header is not {{'format': {FORMAT!r}, 'tree': ..., 'buffers': [...]}}")
    specs, total = [], 0
    for i, spec in enumerate(doc["buffers"]):
        path = f"buffer {i}"
        if not (isinstance(spec, list) and len(spec) == 3 and spec[0] in ("tensor", "ndarray")):
            raise StateDecodingError(f"{path}: {str(spec)[:200]} is not [kind, dtype, shape]")
        kind, name, shape = spec
        dtype = tensor_dtype(name, path) if kind == "tensor" else array_dtype(name, path)
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(type(v) is int and v >= 0 for v in shape)):
            raise StateDecodingError(f"{path}: a shape must be a list of at most {MAX_DIMS} non-negative integers")
        total += math.prod(shape) * dtype.itemsize
        if total > max_bytes:
            raise StateDecodingError(f"the state's arrays would take more than {max_bytes} bytes; refused")
        specs.append((kind, dtype, shape))
    try:
        buffers = [torch.empty(s, dtype=d) if k == "tensor" else np.empty(s, dtype=d) for k, d, s in specs]
    except (RuntimeError, ValueError, TypeError, OverflowError, MemoryError) as exc:  # e.g. shape [0, 2**70]
        reason = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise StateDecodingError(f"the state's arrays cannot be allocated: {type(exc).__name__}: {reason}") from None
    return doc["tree"], buffers


def _bytes_to_fill(buffer: Array) -> torch.Tensor:
    """A flat ``uint8`` view of a freshly allocated (contiguous) tensor or array."""
    if isinstance(buffer, np.ndarray):
        return torch.from_numpy(buffer.reshape(-1).view(np.uint8))
    return buffer.view(-1).view(torch.uint8)


def _is_bool(buffer: Array) -> bool:
    return buffer.dtype == torch.bool if isinstance(buffer, torch.Tensor) else buffer.dtype.kind == "b"


class _Staged:
    """A group that takes its tensors on ``device`` (NCCL): broadcasts a copy there and copies the result back."""

    def __init__(self, pg: dist.ProcessGroup, device: torch.device,
                 wait: Callable[[dist.ProcessGroup, Any], None]) -> None:
        self.pg, self.device, self.settle = pg, device, wait

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        staged = [t.to(self.device) for t in tensors]
        work = self.pg.broadcast(staged, opts)
        return _CopyBack(lambda: self.settle(self.pg, work), tensors, staged)


class _CopyBack:
    def __init__(self, settle: Callable[[], None], tensors: list[torch.Tensor], staged: list[torch.Tensor]) -> None:
        self.settle, self.tensors, self.staged = settle, tensors, staged

    def wait(self) -> None:
        self.settle()  # (raises when the broadcast failed: nothing failed is copied back)
        for tensor, staged in zip(self.tensors, self.staged):
            tensor.copy_(staged)


def _broadcast(pg: dist.ProcessGroup, root: int, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    pg.broadcast([tensor], opts).wait()


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that says
        return 1 << 50
