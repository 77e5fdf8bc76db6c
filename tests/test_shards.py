"""Per-shard state (tensor x pipeline parallelism) and the engine's group transports, in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from unicron_elastic.api import ConfigError
from unicron_elastic.strategy.snapshots.wire import newest_common_step
from unicron_elastic.strategy.snapshots.tiers import DiskCheckpoints, MemorySnapshot
from unicron_elastic.strategy.engine.transport import GlooTransport, NcclTransport, is_peer_failure, transport_for

SHARDS = ["tp0-pp0", "tp1-pp0"]


def state(step: int, shard: str) -> dict:
    return {"step": step, "weights": torch.full((3,), float(step)), "shard": shard}


def test_newest_common_step_is_the_newest_step_every_shard_has() -> None:
    assert newest_common_step({"a": [1, 2, 3], "b": [2, 3, 4]}, ["a", "b"]) == 3
    assert newest_common_step({"a": [3], "b": [2]}, ["a", "b"]) is None
    assert newest_common_step({"a": [5]}, ["a", "b"]) is None  # a shard with nothing
    assert newest_common_step({}, []) is None


def test_memory_snapshots_per_shard_resume_at_the_newest_step_every_shard_has() -> None:
    store = dist.HashStore()
    savers = {shard: MemorySnapshot(store, 1, shard, SHARDS) for shard in SHARDS}
    for step in (1, 2):
        for shard, saver in savers.items():
            saver.save(state(step, shard))
            saver.wait()
    savers["tp0-pp0"].save(state(3, "tp0-pp0"))  # step 3 landed for one shard only: its writer died
    savers["tp0-pp0"].wait()
    for shard, saver in savers.items():
        loaded = saver.load()
        assert (loaded["step"], loaded["shard"]) == (2, shard)  # not 3: the other shard has no step 3
        assert torch.equal(loaded["weights"], torch.full((3,), 2.0))
    assert savers["tp0-pp0"].load(3)["step"] == 3  # a chosen step, this shard's
    assert savers["tp1-pp0"].load(3) is None
    assert savers["tp0-pp0"].load(1) is None and savers["tp1-pp0"].load(1)["step"] == 1  # two slots per shard


def test_disk_checkpoints_per_shard_resume_at_the_newest_step_every_shard_has(tmp_path: Path) -> None:
    savers = {shard: DiskCheckpoints(tmp_path, 1, keep=2, shard=shard, shards=SHARDS) for shard in SHARDS}
    for step in (1, 2, 3):
        for shard, saver in savers.items():
            if step < 3 or shard == "tp0-pp0":
                saver.save(step, state(step, shard))
                saver.wait()
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-00000001.tp1-pp0.state", "step-00000002.tp0-pp0.state", "step-00000002.tp1-pp0.state",
        "step-00000003.tp0-pp0.state"]  # two newest per shard
    for shard, saver in savers.items():
        assert saver.latest_step() == 2
        assert (saver.load()["step"], saver.load()["shard"]) == (2, shard)
    assert savers["tp0-pp0"].load(3)["step"] == 3 and savers["tp1-pp0"].load(3) is None
    assert not (tmp_path / "latest").exists()  # no single 'latest' with shards


def test_a_shard_must_be_one_of_the_models_shards(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not one of the model's shards"):
        MemorySnapshot(dist.HashStore(), 1, "tp2-pp0", SHARDS)
    with pytest.raises(ConfigError, match="not one of the model's shards"):
        DiskCheckpoints(tmp_path, 1, shard="tp2-pp0", shards=SHARDS)


def test_the_transport_follows_the_device() -> None:
    assert isinstance(transport_for(torch.device("cpu")), GlooTransport)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="NCCL"):
            NcclTransport(torch.device("cuda", 0))
        with pytest.raises(ConfigError, match="NCCL"):
            transport_for(torch.device("cuda", 0))


def test_a_gloo_peer_failure_is_told_from_a_bug_of_the_model() -> None:
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:5047")
    assert is_peer_failure(gloo)
    assert is_peer_failure(RuntimeError("Connection reset by peer"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"))
    assert not is_peer_failure(ValueError("Connection closed by peer"))  # not a RuntimeError
