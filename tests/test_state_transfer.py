"""A replica's state reaches a joiner tensor by tensor, never as one pickled blob (issue 10).

Every test runs 2-3 gloo members as threads of this process on a HashStore.
A recording wrapper around each group sees every broadcast: none is larger
than the largest array or the header, the root sends contiguous CPU tensors
from their own memory, and receivers receive into the tensors they return.
"""

from __future__ import annotations

import enum
import json
import math
import pickle
import random
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from test_safe_state import raw_bytes, same
from unicron_elastic.api import StateDecodingError, StateEncodingError
from unicron_elastic.strategy.snapshots.safe_state import decode, encode
from unicron_elastic.strategy.engine.state_transfer import FORMAT, MAX_ERROR_BYTES, broadcast_state


class Recording:
    """A process group that records each broadcast (bytes, data pointer) and forwards it."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg = pg
        self.sent: list[tuple[int, int]] = []

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> Any:
        self.sent += [(t.numel() * t.element_size(), t.data_ptr()) for t in tensors]
        return self.pg.broadcast(tensors, opts)


def _groups(world: int) -> list[Recording]:
    store, pgs = dist.HashStore(), [None] * world

    def make(rank: int) -> None:
        pgs[rank] = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=20))

    _together(world, make)
    return [Recording(pg) for pg in pgs]


def _together(world: int, work: Callable[[int], Any]) -> list[Any]:
    """``work(rank)`` on one thread per rank; each rank's result or the exception it raised."""
    results: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a member is still waiting"
    return results


def _broadcast(pgs: list[Recording], root: int, state: Any, **kwargs: Any) -> list[Any]:
    return _together(len(pgs), lambda r: broadcast_state(pgs[r], root, r, state if r == root else None, **kwargs))


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for t in _tensors(k) + _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _realistic_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    read_only = np.arange(4.0)
    read_only.flags.writeable = False
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "params": [torch.nn.Parameter(torch.randn(2, 2)), torch.nn.Parameter(torch.ones(3), requires_grad=False)],
        "dtypes": {"bf16": torch.randn(5).bfloat16(), "f16": torch.randn(2, 3).half(), "i64": torch.arange(-3, 3),
                   "bool": torch.tensor([True, False, True]), "i16": torch.arange(4, dtype=torch.int16),
                   "u16": torch.arange(4, dtype=torch.int16).view(torch.uint16),
                   "f8": torch.randn(3).to(torch.float8_e4m3fn), "c64": torch.randn(2, dtype=torch.complex64),
                   "nan": torch.tensor([math.nan, -0.0, math.inf])},
        "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5),
        "transposed": torch.arange(12.0).reshape(3, 4).t(), "strided": torch.arange(10)[::2],
        "conj": torch.randn(2, dtype=torch.complex64).conj(),
        "numpy": {"a": np.arange(6.0).reshape(2, 3), "big_endian": np.arange(3, dtype=">f8"), "f32": np.float32(1.5),
                  "bool": np.array([True, False]), "fortran": np.asfortranarray(np.arange(6).reshape(2, 3)),
                  "empty": np.zeros((0, 2)), "read_only": read_only},
        "nested": [1, (2.0, "x", None, b"\x00\x80"), {3: "int key", (1, "a"): [math.inf]}, OrderedDict(a=1)],
        "meta": {"size": torch.Size([2, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu")},
        "step": 7,
    }


# -- what arrives ---------------------------------------------------------------------------------
def test_a_realistic_state_arrives_exactly_on_every_member() -> None:
    state = _realistic_state()
    pgs = _groups(3)
    results = _broadcast(pgs, 1, state)
    assert results[1] is state  # the root gets its own state back
    for received in (results[0], results[2]):
        assert same(received, state)
        assert received["model"]._metadata == state["model"]._metadata
        assert type(received["params"][0]) is torch.nn.Parameter and received["params"][0].requires_grad
        assert not received["params"][1].requires_grad
        assert list(received["optimizer"]["state"]) == [0, 1, 2, 3]
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model.load_state_dict(results[0]["model"])
    torch.optim.Adam(model.parameters()).load_state_dict(results[0]["optimizer"])
    torch.set_rng_state(results[0]["rng"]["torch"])
    np.random.set_state(results[0]["rng"]["numpy"])
    random.setstate(results[0]["rng"]["python"])


@pytest.mark.parametrize("state", [None, {"step": 3, "lr": math.nan}, [], {"e": torch.empty(0, 2)}, np.zeros(0)])
def test_states_without_bytes_of_arrays_take_two_broadcasts(state: Any) -> None:
    pgs = _groups(2)
    results = _broadcast(pgs, 0, state)
    assert same(results[1], state)
    assert len(pgs[0].sent) == len(pgs[1].sent) == 2  # the length and the header


def test_every_array_is_its_own_broadcast_from_and_into_its_own_memory() -> None:
    state = {"layers": [torch.randn(256, 64) for _ in range(6)], "head": torch.randn(1024).bfloat16(),
             "moments": np.random.rand(128, 8), "t": torch.arange(12.0).reshape(3, 4).t(), "step": 5}
    pgs = _groups(3)
    results = _broadcast(pgs, 0, state)
    root, header = pgs[0].sent, pgs[0].sent[1][0]
    largest = max(t.numel() * t.element_size() for t in _tensors(state))
    assert len(root) == 2 + 9 and max(size for size, _ in root) <= max(largest + 8, header)
    assert sum(size for size, _ in root) == 8 + header + sum(t.numel() * t.element_size() for t in _tensors(state)) \
        + state["moments"].nbytes
    sent_from = {ptr for _, ptr in root}
    assert all(t.data_ptr() in sent_from for t in state["layers"] + [state["head"]])  # no copy on the root
    assert state["moments"].ctypes.data in sent_from
    for rank in (1, 2):
        assert same(results[rank], state)
        assert [size for size, _ in pgs[rank].sent] == [size for size, _ in root]
        received_into = {ptr for _, ptr in pgs[rank].sent}
        assert all(t.data_ptr() in received_into for t in _tensors(results[rank]))
        assert results[rank]["moments"].ctypes.data in received_into


# -- the root cannot send -------------------------------------------------------------------------
class Mode(enum.Enum):
    FAST = "fast"


def test_a_state_the_format_cannot_carry_fails_on_every_member_at_once() -> None:
    pgs = _groups(3)
    started = time.monotonic()
    results = _broadcast(pgs, 2, {"w": torch.ones(3), "hyper_parameters": {"mode": Mode.FAST}})
    assert time.monotonic() - started < 5  # nobody waited for the group's 20 s timeout
    assert isinstance(results[2], StateEncodingError) and "state['hyper_parameters']['mode']" in str(results[2])
    for rank in (0, 1):
        assert isinstance(results[rank], StateDecodingError)
        assert "could not send its state" in str(results[rank]) and "state['hyper_parameters']['mode']" in str(
            results[rank])
    assert all(len(pg.sent) == 2 for pg in pgs)  # the refusal and its message, no header, no arrays
    assert all(same(r, {"ok": torch.ones(2)}) for r in _broadcast(pgs, 2, {"ok": torch.ones(2)}))  # still in step


def test_a_skeleton_larger_than_receivers_accept_is_refused_by_the_root() -> None:
    pgs = _groups(2)
    results = _broadcast(pgs, 0, {"names": ["x" * 100] * 10}, max_header_bytes=500)
    assert isinstance(results[0], StateEncodingError) and "500" in str(results[0])
    assert isinstance(results[1], StateDecodingError) and "could not send its state" in str(results[1])


# -- a malformed or hostile root ------------------------------------------------------------------
def _send_raw(pg: Recording, header: bytes | None, payloads: list[bytes], length: int | None = None) -> None:
    """A root speaking the wire protocol with arbitrary content."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    n = len(header or b"") if length is None else length
    pg.broadcast([torch.tensor([n], dtype=torch.int64)], opts).wait()
    for data in ([header] if header is not None else []) + payloads:
        pg.broadcast([torch.frombuffer(bytearray(data), dtype=torch.uint8)], opts).wait()


def _header(tree: Any, buffers: list[Any], fmt: str = FORMAT) -> bytes:
    return json.dumps({"format": fmt, "tree": tree, "buffers": buffers}).encode()


def _tensor(i: int, dtype: str = "float32", shape: list[int] | None = None) -> dict[str, Any]:
    return {"$t": "tensor", "i": i, "dtype": dtype, "shape": [2] if shape is None else shape}


F32 = ["tensor", "float32", [2]]
MALFORMED = [  # header, payloads, length, match: refused before (no payloads) or after the arrays arrive
    (pickle.dumps({"w": torch.ones(2)}), [], None, "looks like a pickle"),
    (b"PK\x03\x04" + bytes(40), [], None, "torch.save zip archive"),
    (b"{" + bytes([0xFF]) * 8, [], None, "malformed header"),
    (b"[1, 2]", [], None, "not a JSON object"),
    (b'{"tree": {}, "buffers": []}', [], None, "not {'format'"),
    (_header({}, [], fmt="unicron-state-stream/0"), [], None, "not {'format'"),
    (b'{"format": "' + FORMAT.encode() + b'", "tree": NaN, "buffers": []}', [], None, "bare JSON constant"),
    (b'{"a": ' + b"[" * 100_000, [], None, "malformed header"),
    (_header({}, [["tensor", "object", [1]]]), [], None, "unsupported tensor dtype"),
    (_header({}, [["ndarray", "|O", [1]]]), [], None, "unsupported numpy dtype"),
    (_header({}, [["ndarray", "<f3", [1]]]), [], None, "unsupported numpy dtype"),
    (_header({}, [["pickle", "float32", [1]]]), [], None, r"is not \[kind, dtype, shape\]"),
    (_header({}, [["tensor", "float32", [-1]]]), [], None, "shape"),
    (_header({}, [["tensor", "float32", [1] * 65]]), [], None, "shape"),
    (_header({}, [["tensor", "float32", [2**40]]]), [], None, "more than"),
    (_header({}, [["tensor", "float32", [0, 2**70]]]), [], None, "cannot be allocated"),
    (None, [], 2**40, "announced"),
    (None, [], 0, "announced"),
    (None, [], -(MAX_ERROR_BYTES + 1), "refusal"),
    (_header(_tensor(1), [F32]), [bytes(8)], None, "out of range"),
    (_header(_tensor(0, "int32"), [F32]), [bytes(8)], None, "buffer 0 is a torch tensor of dtype torch.float32"),
    (_header(_tensor(0, shape=[1, 2]), [F32]), [bytes(8)], None, "shape"),
    (_header([_tensor(0), _tensor(0)], [F32]), [bytes(8)], None, "referred to twice"),
    (_header({"$t": "ndarray", "i": 0, "dtype": "<f4", "shape": [2]}, [F32]), [bytes(8)], None, "not a numpy array"),
    (_header({"$t": "ndarray", "i": 0, "dtype": "<f4", "shape": [2], "scalar": True}, [["ndarray", "<f4", [2]]]),
     [bytes(8)], None, "scalar"),
    (_header({"$t": "pickle", "v": "gASVAAAA"}, []), [], None, "unknown or malformed"),
    (_header({"$t": "map", "v": [[[1, 2], 3]]}, []), [], None, "unhashable"),
]


@pytest.mark.parametrize("header, payloads, length, match", MALFORMED, ids=[case[3] for case in MALFORMED])
def test_a_malformed_header_or_skeleton_is_refused_by_every_receiver(header: bytes | None, payloads: list[bytes],
                                                                     length: int | None, match: str) -> None:
    pgs = _groups(3)
    results = _together(3, lambda r: _send_raw(pgs[0], header, payloads, length) if r == 0
                        else broadcast_state(pgs[r], 0, r))
    assert results[0] is None  # the root got through every broadcast it made
    for rank in (1, 2):
        assert isinstance(results[rank], StateDecodingError), results[rank]
        assert re.search(match, str(results[rank])), str(results[rank])


def test_receivers_refuse_arrays_beyond_their_limit() -> None:
    pgs = _groups(2)
    results = _together(2, lambda r: _send_raw(pgs[0], _header(_tensor(0, shape=[1024]), [["tensor", "float32",
                                                                                            [1024]]]), [])
                        if r == 0 else broadcast_state(pgs[r], 0, r, max_bytes=4095))
    assert isinstance(results[1], StateDecodingError) and "more than 4095 bytes" in str(results[1])


def test_bool_bytes_other_than_0_and_1_arrive_as_true() -> None:
    pgs = _groups(2)
    tree = {"t": _tensor(0, "bool", [3]), "a": {"$t": "ndarray", "i": 1, "dtype": "|b1", "shape": [2]}}
    header = _header(tree, [["tensor", "bool", [3]], ["ndarray", "|b1", [2]]])
    results = _together(2, lambda r: _send_raw(pgs[0], header, [bytes([0, 7, 255]), bytes([2, 0])]) if r == 0
                        else broadcast_state(pgs[r], 0, r))
    assert results[1]["t"].tolist() == [False, True, True] and results[1]["t"].view(torch.uint8).tolist() == [0, 1, 1]
    assert results[1]["a"].view(np.uint8).tolist() == [1, 0]


# -- safe_state.decode, which the receivers use -------------------------------------------------------
def test_decode_rebuilds_an_encoded_state_around_its_own_buffers() -> None:
    state = _realistic_state()
    encoded = encode(state)
    back = decode(encoded.tree, encoded.buffers)
    assert same(back, state)
    assert back["model"]["0.weight"].data_ptr() == state["model"]["0.weight"].data_ptr()  # not copied


@pytest.mark.parametrize("buffers, match", [
    ([], "out of range"),
    ([np.zeros(2, dtype=np.float32)], "numpy array of dtype float32 and shape \\[2\\], not a torch tensor"),
    ([torch.zeros(2, dtype=torch.float64)], "dtype torch.float32"),
    ([torch.zeros(3)], r"shape \[2\]"),
])
def test_decode_refuses_buffers_that_do_not_match_the_skeleton(buffers: list[Any], match: str) -> None:
    with pytest.raises(StateDecodingError, match=match):
        decode({"w": _tensor(0)}, buffers)
