"""A stop one rank is asked for (SIGTERM under the Lightning strategy), in one process with a real engine.

The stop rides in the slots of the step's last exchange (here the last gradient
bucket of a one-rank group): no collective of its own. A rank that stops records
the step, so ranks whose exchange failed learn it when their next group forms.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from unicron_elastic.store.keys import MeetingKeys as K
from unicron_elastic.strategy.engine import effects as E
from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel, EngineOptions
from unicron_elastic.strategy.engine.microbatch import GlobalBatchPlan

DATA = torch.randn(8, 3, generator=torch.Generator().manual_seed(3))


def engine(loss_fn=lambda model, batch: model(batch).pow(2).mean()) -> ElasticDataParallel:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return ElasticDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               batch_plan=GlobalBatchPlan(len(DATA), 4, 2, seed=0), batch=lambda idx: DATA[idx],
                               loss_fn=loss_fn, store=dist.HashStore(), rank=0, world_size=1,
                               options=EngineOptions(timeout=timedelta(seconds=30)))


def test_a_stop_asked_while_a_step_computes_is_agreed_in_that_steps_exchange() -> None:
    asked = []

    def loss(model, batch):
        if len(asked) == 0 and e.next_step == 1:  # while step 1 computes: a signal handler would call this
            e.request_stop()
            asked.append(1)
        return model(batch).pow(2).mean()

    e = engine(loss)
    e.train_step(0)
    assert not e.reduction.stop_agreed
    e.next_step = 1
    e.train_step(1)
    assert asked and e.reduction.stop_requested and e.reduction.stop_agreed


def test_the_stop_slot_is_summed_beside_the_members_and_sent_on_by_whoever_saw_it() -> None:
    e = engine()
    slots = e.reduction._encode([0], torch.float64)
    assert slots.tolist()[-1] == 0 and e.reduction._exchanged(slots).members == [0] and not e.reduction.stop_agreed
    other = e.reduction._encode(None, torch.float64)
    other[-1] = 1  # another rank asked: the sum carries it
    assert e.reduction._exchanged(slots + other).members == [0]
    assert e.reduction.stop_agreed and e.reduction.stop_requested  # this rank now sends it in every exchange too
    assert e.reduction._encode(None, torch.float64).tolist()[-1] == 1


def test_ranks_that_regroup_after_the_stop_step_learn_it_when_their_group_forms() -> None:
    stopped, behind = engine(), engine()
    behind.store_effects.store = stopped.store_effects.store  # (one meeting store)
    stopped.stopping(4)
    assert stopped.store_effects.store.get(K.STOP) == b"4"
    assert not behind.reduction.stop_requested
    behind._formed(E.Formed(1, (0,)))  # what a regroup's new group runs once formed
    assert behind.reduction.stop_requested and not behind.reduction.stop_agreed  # its next exchange carries it to every member
