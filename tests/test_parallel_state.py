"""megatron-core parallel_state groups built (and rebuilt smaller) by the strategy's build_world, on gloo."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import REPO
from unicron_elastic.api import ConfigError
from unicron_elastic.strategy.lightning.parallel import check_sizes
from unicron_elastic.strategy.engine.replicas import ModelParallel
from unicron_elastic.testing import run_workers

WORKER = os.path.join(REPO, "tests", "workers", "parallel_state_worker.py")


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_groups_for_every_tp_pp_split_of_4_ranks_and_a_rebuild(tmp_path: Path) -> None:
    results = run_workers(WORKER, 4, [str(tmp_path)], timeout=150)
    assert [r.returncode for r in results] == [0] * 4, results[0].stderr[-3000:]
    seen = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)}
    for name, (tp, pp) in {"1x1": (1, 1), "2x1": (2, 1), "1x2": (1, 2), "2x2": (2, 2)}.items():
        for r in range(4):
            got = seen[r][name]
            assert (got["tp"], got["pp"], got["dp"], got["world"]) == (tp, pp, 4 // (tp * pp), 4)
        # every (tp, pp, dp) coordinate is taken by exactly one rank, laid out replica-major like ModelParallel
        coords = {(seen[r][name]["tp_rank"], seen[r][name]["pp_rank"], seen[r][name]["dp_rank"]) for r in range(4)}
        assert len(coords) == 4
        layout = ModelParallel(tp, pp)
        for r in range(4):
            got = seen[r][name]
            assert (got["tp_rank"], got["pp_rank"], got["dp_rank"]) == \
                (layout.tensor_rank(r), layout.stage(r), layout.replica(r)), (name, r)
    for r in (0, 1):
        after = seen[r]["after_shrink_2x1"]
        assert (after["tp"], after["dp"], after["world"], after["tp_rank"]) == (2, 1, 2, r)
    assert "after_shrink_2x1" not in seen[2]


def test_bad_sizes_are_clear_errors() -> None:
    assert check_sizes(8, 2, 2) == 2
    with pytest.raises(ConfigError, match="multiple"):
        check_sizes(6, 4, 1)
    with pytest.raises(ConfigError, match=">= 1"):
        check_sizes(4, 0, 1)
