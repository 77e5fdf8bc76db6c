"""Lightning checkpoints of a model with TP x PP > 1: a directory of one file per shard (``tp<t>-pp<p>.ckpt``).

Every data-parallel replica holds the same state, so each shard's file is
written by that shard's rank of one replica; a resume (``ckpt_path``) reads
this rank's shard only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unicron_elastic.api import ConfigError


def shard_file(directory: Any, shard: str) -> Path:
    """The file of ``shard`` (its label, ``tp<t>-pp<p>``) in the checkpoint ``directory``."""
    return Path(directory) / f"{shard}.ckpt"


def save_shard(checkpoint_io: Any, checkpoint: dict[str, Any], directory: Any, shard: str,
               storage_options: Any = None) -> None:
    """Write this rank's ``checkpoint`` as ``shard``'s file of ``directory`` through Lightning's ``checkpoint_io``."""
    checkpoint_io.save_checkpoint(checkpoint, shard_file(directory, shard), storage_options=storage_options)


def load_shard(checkpoint_io: Any, directory: Any, shard: str, weights_only: bool | None = None) -> dict[str, Any]:
    """``shard``'s checkpoint in ``directory``.

    Raises:
        ConfigError: ``directory`` is not a directory of shards, or lacks ``shard``'s file.
    """
    path = shard_file(directory, shard)
    if not path.is_file():
        raise ConfigError(f"{directory} has no shard {path.name}: a checkpoint of a model with TP x PP > 1 "
                          "is a directory of one file per shard, as save_checkpoint writes it")
    return checkpoint_io.load_checkpoint(path, weights_only=weights_only)
