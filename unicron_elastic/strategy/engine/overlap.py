"""Each bucket's all-reduce started from backward, as soon as its gradients of the step are summed.

torch's DDP and megatron-core's (``overlap_grad_reduce``) reduce a bucket
while backward computes the gradients of earlier layers. The engine does the
same on this rank's last micro-batch of a step: a post-accumulate-grad hook
of every parameter counts the gradients each bucket still waits for, and a
bucket whose count reaches zero is started (:class:`~unicron_elastic.strategy.engine.reduction.StepReduction`
copies it out of the local sum and starts its all-reduce without waiting). The
flat sum lays the parameters out in the reverse of their registration order
(:meth:`~unicron_elastic.strategy.engine.elastic_dp.ElasticDataParallel.bind`),
so the last layers, whose gradients backward computes first, fill bucket 0.

Buckets start in their order only (bucket *k* after bucket *k - 1*), on every
rank: a group's collectives must be issued in the same order by all its
members, and which gradients a rank's backward computes first may depend on its
data. Nothing is decided here: the protocol's ``Reduce`` of each bucket waits
for it (or starts it, when backward did not), and a failure surfaces there,
at the step's commit, as before. What is never started from backward:

* the bucket that carries the step's slots (the next members, the verdicts),
  which the protocol fills after the computation;
* any bucket on a recomputation after a failure, with pipeline parallelism
  (our schedule's backward interleaves micro-batches), or with
  megatron-core's gradient-accumulation fusion into float32 buffers beside a
  float64 sum -- there the buckets start one after the other when the
  reduction begins, each while the previous ones are in flight;
* a bucket one of whose gradients did not arrive in its parameter's view of
  the sum (unused in this backward, or ``.grad`` replaced by a hook): it
  starts when the reduction begins.

Where the sum is not the gradients' own buffer (float64 sums of float32
parameters), the hook adds each gradient to the sum itself and clears
``.grad``: the same addition, in the same order, as after the backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from unicron_elastic.strategy.engine.gradients import GradientBuffer

__all__ = ["BucketLauncher"]


class BucketLauncher:
    """Starts buckets from the post-accumulate-grad hooks of one backward (the rank's last micro-batch).

    Args:
        gradients: The gradient sums (their buckets and the parameters' spans in them).
        launchable: How many buckets, from bucket 0, may start from backward (those before the slots' bucket).
        start: ``start(step, bucket, local)``: copy the bucket out of the local sum and start its reduction.
        on_started: ``on_started(step, bucket)``, after a bucket started from backward (a fault point).
    """

    def __init__(self, gradients: GradientBuffer, launchable: int, start: Callable[[int, int, torch.Tensor], None],
                 on_started: Callable[[int, int], None] = lambda step, bucket: None) -> None:
        self.gradients, self.launchable, self._start, self._on_started = gradients, launchable, start, on_started
        spans = gradients.spans()
        #: The buckets each parameter's gradient is part of (a parameter may straddle two).
        self._buckets_of = [[k for k, (lo, hi) in enumerate(gradients.bounds) if lo < end and start < hi]
                            for start, end in spans]
        self._needed = [sum(k in ks for ks in self._buckets_of) for k in range(len(gradients.bounds))]
        self._index = {id(p): i for i, p in enumerate(gradients.params)}
        self._armed: tuple[int, torch.Tensor, list[torch.Tensor], bool] | None = None
        self._left: list[int] = []
        self._next = 0
        #: Buckets started from backward in the last armed backward.
        self.started = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._summed) for p in gradients.params]

    def arm(self, step: int, local: torch.Tensor, views: list[torch.Tensor], adds: bool) -> None:
        """The next backward is this rank's last of ``step``: start buckets from it.

        Args:
            step: The step.
            local: The local sum (``views``: its parameters' views).
            adds: ``.grad`` is not the view (float64 sums): the hook adds it to the view and clears it.
        """
        self._armed = (step, local, views, adds)
        self._left, self._next, self.started = list(self._needed), 0, 0

    def disarm(self) -> None:
        """The backward is over: hooks start nothing until armed again."""
        self._armed = None

    def remove(self) -> None:
        """Remove the hooks from the parameters."""
        self.disarm()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _summed(self, param: torch.Tensor) -> None:
        """(Autograd's hook) ``param``'s gradient of this backward is summed: start the buckets complete."""
        armed = self._armed
        if armed is None:
            return
        step, local, views, adds = armed
        i = self._index[id(param)]
        grad = param.grad
        if grad is not None and adds:
            views[i].add_(grad)  # in place into the sum's dtype, as GradientBuffer.accumulate adds it
            param.grad = None
        elif grad is None or grad.data_ptr() != views[i].data_ptr():
            self._armed = None  # not summed in place: the remaining buckets start with the reduction
            return
        for k in self._buckets_of[i]:
            self._left[k] -= 1
        while self._next < self.launchable and self._left[self._next] == 0:
            self._start(step, self._next, local)
            self._next += 1
            self.started += 1
            self._on_started(step, self._next - 1)
