"""State that crosses the network or the disk loads without running code (issue 9, item 3).

Snapshots in the agent's TCPStore, the state a replica broadcasts to a joiner,
and disk checkpoints are tensors plus a JSON skeleton
(``unicron_elastic.strategy.snapshots.safe_state``). A pickle put where one of them is
read (the "attacker" writes a payload whose ``__reduce__`` creates a marker
file) must be refused with a clear error, and the marker must not exist.
"""

from __future__ import annotations

import enum
import io
import json
import math
import pickle
import random
import struct
import threading
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from unicron_elastic.api import StateDecodingError, StateEncodingError
from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel, EngineOptions
from unicron_elastic.strategy.engine.effects import TransferState
from unicron_elastic.strategy.snapshots.safe_state import MAGIC, dumps, encode, loads, pack
from unicron_elastic.store.keys import MeetingKeys
from unicron_elastic.strategy.snapshots.wire import PIECE_BYTES, SNAPSHOT_KEY
from unicron_elastic.strategy.snapshots.tiers import DiskCheckpoints, MemorySnapshot


class _Evil:
    """Unpickling this creates ``marker`` (what an attacker's payload would do, harmlessly)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def _torch_pickle(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"step": 3, "model": {"w": torch.ones(2)}, "payload": _Evil(marker)}, buffer)
    return buffer.getvalue()


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a flat uint8 tensor (conjugate and negative views resolved)."""
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def same(a: Any, b: Any) -> bool:
    """Equal in type and value, to the bit (NaN equals NaN, -0.0 differs from 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
                and torch.equal(raw_bytes(a), raw_bytes(b)))
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        if getattr(a, "_metadata", None) != getattr(b, "_metadata", None):
            return False
        return len(a) == len(b) and all(same(ka, kb) and same(va, vb)
                                        for (ka, va), (kb, vb) in zip(a.items(), b.items()))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# -- the envelope ---------------------------------------------------------------------------------
TENSOR_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                 torch.uint8, torch.int8, torch.bool, torch.complex64]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(TENSOR_DTYPES))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * 100
    if values.numel() and draw(st.booleans()):
        values.view(-1)[0] = draw(st.sampled_from([math.nan, math.inf, -math.inf, -0.0]))
    tensor = values.to(torch.complex64) if dtype.is_complex else values.to(dtype) if dtype.is_floating_point \
        else values.nan_to_num().clamp(-100, 100).to(dtype)
    if draw(st.booleans()) and dtype.is_floating_point:
        return torch.nn.Parameter(tensor, requires_grad=draw(st.booleans()))
    return tensor.t() if tensor.dim() == 2 else tensor  # a non-contiguous view now and then


arrays = hnp.arrays(st.sampled_from([np.float64, np.float32, np.int32, np.uint32, np.bool_, np.complex128,
                                     np.dtype(">f8"), np.uint8]),
                    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=8)
           | st.sampled_from([np.float64(1.5), np.int64(-3), np.bool_(True), np.float32(math.nan)])
           | st.sampled_from([torch.Size([2, 0]), torch.float16, torch.device("cpu"), torch.bool]))
keys = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
        | st.just("$t") | st.tuples(st.integers(), st.text(max_size=4)))
states = st.recursive(
    scalars | tensors() | arrays,
    lambda children: (st.lists(children, max_size=4) | st.lists(children, max_size=4).map(tuple)
                      | st.dictionaries(st.text(max_size=8), children, max_size=4)
                      | st.dictionaries(keys, children, max_size=4)
                      | st.dictionaries(st.text(max_size=8), children, max_size=4).map(OrderedDict)),
    max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states)
def test_encode_decode_round_trip_is_exact(state: Any) -> None:
    assert same(loads(dumps(state)), state)


def test_a_lightning_like_state_round_trips_bit_exactly() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95))
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    state = {"lightning": {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()],
                           "callbacks": {"EarlyStopping{'monitor': 'loss'}": {"best_score": torch.tensor(math.inf)}},
                           "hyper_parameters": {"lr": 1e-3, "betas": (0.9, 0.95), "bad": math.nan}},
             "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
             "step": 7}
    back = loads(dumps(state))
    assert same(back, state)
    assert back["lightning"]["state_dict"]._metadata == state["lightning"]["state_dict"]._metadata
    assert list(back["lightning"]["optimizer_states"][0]["state"]) == [0, 1, 2, 3]  # parameter numbers, ints
    random.setstate(back["rng"]["python"])
    np.random.set_state(back["rng"]["numpy"])
    torch.set_rng_state(back["rng"]["torch"])
    fresh = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95))
    fresh.load_state_dict(back["lightning"]["optimizer_states"][0])


class Mode(enum.Enum):
    FAST = "fast"


@pytest.mark.parametrize("state, path, what", [
    ({"hyper_parameters": {"mode": Mode.FAST}}, "state['hyper_parameters']['mode']", "Mode"),
    ({"x": [1, (2, {3})]}, "state['x'][1][1]", "builtins.set"),
    ({"a": np.array([object()], dtype=object)}, "state['a']", "numpy ndarray of dtype object"),
    ({"s": torch.eye(2).to_sparse()}, "state['s']", "layout torch.sparse_coo"),
    ({"k": {Mode.FAST: 1}}, "state['k'] (key <Mode.FAST: 'fast'>)", "Mode"),
    ({"n": 1 + 2j}, "state['n']", "builtins.complex"),
])
def test_values_the_format_cannot_carry_are_refused_at_save_time_by_path(state: Any, path: str, what: str) -> None:
    with pytest.raises(StateEncodingError) as err:
        dumps(state)
    assert path in str(err.value) and what in str(err.value)


def test_a_memory_snapshot_with_an_unsupported_value_fails_at_save_not_in_the_background() -> None:
    snapshot = MemorySnapshot(dist.HashStore(), every=1)
    with pytest.raises(StateEncodingError, match=r"state\['hyper_parameters'\]\['mode'\]"):
        snapshot.save({"hyper_parameters": {"mode": Mode.FAST}, "step": 0})
    assert snapshot.load() is None


def test_encode_with_copy_is_not_changed_by_training_afterwards() -> None:
    weight = torch.zeros(3)
    encoded = encode({"w": weight, "a": np.zeros(2)}, copy=True)
    weight.add_(1)
    assert torch.equal(loads(pack(encoded))["w"], torch.zeros(3))


def _document(tree: Any, buffers: list[list[int]], data: bytes = b"") -> bytes:
    header = json.dumps({"tree": tree, "buffers": buffers}).encode()
    head = MAGIC + struct.pack("<Q", len(header)) + header
    return head + bytes(-len(head) % 64) + data


@pytest.mark.parametrize("data, match", [
    (pickle.dumps({"a": 1}), "looks like a pickle"),
    (b"PK\x03\x04" + bytes(40), "torch.save zip archive"),
    (b"", "not a unicron state document"),
    (MAGIC + struct.pack("<Q", 10**12), "truncated"),
    (_document({"$t": "tensor", "i": 0, "dtype": "float32", "shape": [4]}, [[0, 16]]), "past the end"),
    (_document({"$t": "tensor", "i": 0, "dtype": "float32", "shape": [5]}, [[0, 16]], bytes(16)), "do not hold"),
    (_document({"$t": "tensor", "i": 3, "dtype": "float32", "shape": [1]}, [[0, 4]], bytes(4)), "out of range"),
    (_document({"$t": "tensor", "i": 0, "dtype": "object", "shape": [1]}, [[0, 8]], bytes(8)), "dtype"),
    (_document({"$t": "ndarray", "i": 0, "dtype": "|O", "shape": [1]}, [[0, 8]], bytes(8)), "dtype"),
    (_document({"$t": "pickle", "v": "gASVAAAA"}, []), "unknown or malformed"),
    (_document({"$t": "map", "v": [[[1, 2], 3]]}, []), "unhashable"),
    (_document({"$t": "float", "v": "1e400"}, []), "unknown or malformed"),
    (MAGIC + struct.pack("<Q", 3) + b"NaN", "bare JSON constant NaN"),
    (MAGIC + struct.pack("<Q", 200_000) + b"[" * 200_000, "malformed"),
])
def test_documents_that_are_not_safe_state_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(StateDecodingError, match=match):
        loads(data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_documents_decode_or_are_refused_never_crash(data: st.DataObject) -> None:
    document = bytearray(dumps({"w": torch.arange(6.0).reshape(2, 3), "k": {1: (np.ones(2), "x")}, "s": 3}))
    for _ in range(data.draw(st.integers(1, 4))):
        document[data.draw(st.integers(0, len(document) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(document)))
    try:
        loads(bytes(document[:cut]))
    except StateDecodingError:
        pass


# -- where states are read: nothing runs --------------------------------------------------------
def test_a_pickle_in_the_agents_tcpstore_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    attacker = dist.TCPStore("127.0.0.1", agent.port, is_master=False, timeout=timedelta(seconds=30))
    attacker.set(SNAPSHOT_KEY, _torch_pickle(marker))  # no authentication: anyone reaching the port can
    with pytest.raises(StateDecodingError, match="pickle|torch.save"):
        MemorySnapshot(agent, every=1).load()
    assert not marker.exists()


def test_memory_snapshot_round_trips_through_the_tcpstore() -> None:
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    state = {"model": torch.nn.Linear(3, 2).state_dict(), "rng": torch.get_rng_state(), "step": 4}
    snapshot = MemorySnapshot(agent, every=1)
    snapshot.save(state)
    snapshot.wait()
    assert same(snapshot.load(), state)


def _agent_and_worker_stores() -> tuple[dist.TCPStore, dist.TCPStore]:
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    return agent, dist.TCPStore("127.0.0.1", agent.port, is_master=False, timeout=timedelta(seconds=30))


def test_a_snapshot_over_the_stores_message_limit_is_written_in_pieces_and_the_connection_survives() -> None:
    """torch's TCPStore server closes a client that sends more than 8 MiB at once: a 20 MiB state
    (a width-512 GPT with AdamW) used to lose the snapshot and, sharing the worker's connection, the store."""
    agent, worker = _agent_and_worker_stores()
    state = {"w": torch.arange(5 * (1 << 20), dtype=torch.float32), "step": 3}  # 20 MiB
    snapshot = MemorySnapshot(worker, every=1)
    snapshot.save(state)
    snapshot.wait()
    head = json.loads(agent.get(SNAPSHOT_KEY))
    assert head["pieces"] == -(-head["bytes"] // PIECE_BYTES) >= 5
    worker.set("still-connected", "yes")  # the worker's own connection is intact
    assert same(MemorySnapshot(agent, every=1).load(), state)


def test_a_new_snapshot_deletes_the_previous_ones_pieces_after_replacing_its_head() -> None:
    agent, worker = _agent_and_worker_stores()
    snapshot = MemorySnapshot(worker, every=1)
    heads = []
    for step in (1, 2):
        snapshot.save({"w": torch.full((PIECE_BYTES // 4 + 1,), float(step)), "step": step})  # two pieces
        snapshot.wait()
        heads.append(json.loads(agent.get(SNAPSHOT_KEY)))
    first, second = (lambda h: [MeetingKeys.snapshot_piece(SNAPSHOT_KEY, h["tag"], i) for i in range(h["pieces"])]
                     for h in heads)
    assert heads[0]["pieces"] == 2 and not any(agent.check([key]) for key in first(heads[0]))
    assert agent.check(second(heads[1])) and MemorySnapshot(agent, every=1).load()["step"] == 2


def test_a_snapshot_whose_pieces_vanished_while_read_is_skipped_with_a_warning(capsys) -> None:
    agent, worker = _agent_and_worker_stores()
    snapshot = MemorySnapshot(worker, every=1)
    snapshot.save({"w": torch.ones(4), "step": 1})
    snapshot.wait()
    head = json.loads(agent.get(SNAPSHOT_KEY))
    agent.delete_key(MeetingKeys.snapshot_piece(SNAPSHOT_KEY, head["tag"], 0))  # a newer upload's clean-up
    assert MemorySnapshot(agent, every=1).load() is None
    assert "snapshot_changed_while_read" in capsys.readouterr().out


@pytest.mark.parametrize("head", [b'{"pieces": 1, "bytes": 99, "tag": "t"}', b'{"pieces": 0, "bytes": 0, "tag": "t"}',
                                  b'{"pieces": 1, "bytes": 1, "tag": "../x"}', b'[1]', b"\x80\x04K\x01."])
def test_a_malformed_snapshot_head_is_refused(head: bytes) -> None:
    agent, attacker = _agent_and_worker_stores()
    attacker.set(MeetingKeys.snapshot_piece(SNAPSHOT_KEY, "t", 0), dumps({"step": 1}))
    attacker.set(SNAPSHOT_KEY, head)
    with pytest.raises(StateDecodingError, match="refused"):
        MemorySnapshot(agent, every=1).load()


@pytest.mark.parametrize("layout", ["dcp-directory", "state-file"])
def test_a_planted_checkpoint_is_refused_and_runs_nothing(tmp_path: Path, layout: str) -> None:
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if layout == "dcp-directory":  # torch.distributed.checkpoint unpickles .metadata
        (ckpt / "step-00000005").mkdir()
        (ckpt / "step-00000005" / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
        name = "step-00000005"
    else:
        name = "step-00000005.state"
        (ckpt / name).write_bytes(_torch_pickle(marker))
    (ckpt / "latest").write_text(json.dumps({"step": 5, "path": name}))
    with pytest.raises(StateDecodingError, match="refus"):
        DiskCheckpoints(ckpt, every=1).load()
    assert not marker.exists()


def test_a_latest_marker_pointing_outside_the_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "elsewhere.state").write_bytes(dumps({"step": 1}))
    (tmp_path / "ckpt" / "latest").write_text(json.dumps({"step": 1, "path": "../elsewhere.state"}))
    with pytest.raises(StateDecodingError, match="latest"):
        DiskCheckpoints(tmp_path / "ckpt", every=1).load()


def test_disk_checkpoints_round_trip_and_keep_the_newest(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    disk = DiskCheckpoints(tmp_path, every=1, keep=2)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.add_(1)
        state = {"model": model.state_dict(), "step": step}
        disk.save(step, state)
        disk.wait()
    assert disk.latest_step() == 3
    assert same(disk.load(), state)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002.state", "step-00000003.state"]


def test_a_stale_checkpoint_writer_never_marks_an_older_step_latest(tmp_path: Path) -> None:
    """A writer frozen with an old step and resumed after the group wrote a newer one: the step fences it."""
    new, stale = DiskCheckpoints(tmp_path, every=1, keep=3), DiskCheckpoints(tmp_path, every=1, keep=3)
    new.save(7, {"model": {"w": torch.ones(2)}, "step": 7})
    new.wait()
    stale.save(5, {"model": {"w": torch.zeros(2)}, "step": 5})
    stale.wait()
    assert new.latest_step() == 7 and same(new.load(), {"model": {"w": torch.ones(2)}, "step": 7})


def test_a_writer_frozen_between_its_check_and_its_mark_gives_the_mark_back(tmp_path: Path, monkeypatch,
                                                                            capture_log) -> None:
    """Its check passed before the freeze (step 4 was the newest); resumed after step 7 was saved, it marks step 5,
    finds the newer checkpoint and marks that one again: ``latest`` ends on step 7, and it says so."""
    from unicron_elastic.strategy.snapshots import tiers

    logs = capture_log(tiers)
    new, stale = DiskCheckpoints(tmp_path, every=1, keep=3), DiskCheckpoints(tmp_path, every=1, keep=3)
    new.save(7, {"model": {"w": torch.ones(2)}, "step": 7})
    new.wait()
    monkeypatch.setattr(stale, "latest_step", lambda: 4)
    stale.save(5, {"model": {"w": torch.zeros(2)}, "step": 5})
    stale.wait()
    assert new.latest_step() == 7 and same(new.load(), {"model": {"w": torch.ones(2)}, "step": 7})
    said = [(e["event"], e["step"]) for e in logs.entries if e["event"].startswith("checkpoint_")]
    assert said == [("checkpoint_saved", 7), ("checkpoint_stale_not_marked", 5)]
    assert not list(tmp_path.glob("latest*.tmp"))


def _engines(store: dist.Store, **kwargs: Any) -> ElasticDataParallel:
    torch.manual_seed(kwargs.pop("seed", 0))
    model = torch.nn.Linear(4, 2)
    return ElasticDataParallel(model, torch.optim.Adam(model.parameters()), batch_plan=None, batch=lambda idx: idx,
                               loss_fn=lambda m, b: m(b).sum(), store=store, world_size=2,
                               options=EngineOptions(timeout=timedelta(seconds=30)), **kwargs)


def _broadcast_raw(store: dist.Store, payload: bytes) -> None:
    """A member at index 0 of generation 0 that sends ``payload`` as its state (the wire protocol)."""
    pg = dist.ProcessGroupGloo(dist.PrefixStore("unicron-dp/gen0/pg", store), 0, 2, timedelta(seconds=30))
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([torch.tensor([len(payload)], dtype=torch.int64)], opts).wait()
    pg.broadcast([torch.frombuffer(bytearray(payload), dtype=torch.uint8)], opts).wait()


def test_a_pickle_broadcast_by_a_peer_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    store = dist.HashStore()
    sender = threading.Thread(target=_broadcast_raw, args=(store, _torch_pickle(marker)), daemon=True)
    sender.start()
    joiner = _engines(store, rank=1)
    with pytest.raises(StateDecodingError, match="pickle|torch.save"):
        joiner.handout.transfer(TransferState(0, apply=True))
    sender.join(30)
    assert not marker.exists()


def test_state_broadcast_between_replicas_is_bit_exact() -> None:
    store = dist.HashStore()
    engines: dict[int, ElasticDataParallel] = {}

    def build(rank: int) -> None:
        engines[rank] = _engines(store, rank=rank, seed=rank)

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    primary, joiner = engines[0], engines[1]
    primary.model(torch.randn(3, 4)).sum().backward()
    primary.optimizer.step()
    primary.next_step = 5
    sent = threading.Thread(target=primary.handout.transfer, args=(TransferState(0, apply=False),))
    sent.start()
    joiner.handout.transfer(TransferState(0, apply=True))
    sent.join(30)
    assert joiner.next_step == 5
    assert all(torch.equal(a, b) for a, b in zip(primary.model.parameters(), joiner.model.parameters()))
    assert same(joiner.optimizer.state_dict(), primary.optimizer.state_dict())
