"""One shard's gradient sums: the local sum of its micro-batches, the buffer its buckets are reduced in, ``p.grad``.

Gradients are summed over micro-batches (in ``grad_dtype``) and divided by B
once reduced, so the result does not depend on which rank computed which
micro-batch. The local sum stays whole while its buckets are reduced in a
copy: after a failure the survivors add the lost rank's micro-batches to it
and reduce again (:mod:`~unicron_elastic.strategy.engine.elastic_dp`).
"""

from __future__ import annotations

import torch

from unicron_elastic.api import ConfigError


class GradientBuffer:
    """The gradient sums of ``params``, bucket by bucket.

    Args:
        params: The parameters that require a gradient (this rank's shard).
        grad_dtype: Dtype of the sums and of their all-reduce.
        bucket_numel: Elements per bucket (None: one bucket).

    Raises:
        ConfigError: ``params`` is empty.
    """

    def __init__(self, params: list[torch.nn.Parameter], grad_dtype: torch.dtype, bucket_numel: int | None) -> None:
        if not params:
            raise ConfigError("the model has no parameter that requires a gradient")
        self.params, self.grad_dtype = params, grad_dtype
        self.numel = sum(p.numel() for p in params)
        size = bucket_numel or self.numel
        #: ``(start, end)`` of each bucket in the flat sum.
        self.bounds = [(start, min(start + size, self.numel)) for start in range(0, self.numel, size)]
        self._sum: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # the step's local sum (reused)
        #: Where the step's buckets are reduced (reused; see :meth:`reduce_buffer`).
        self.reduced: torch.Tensor | None = None
        self._reduced_views: list[torch.Tensor] | None = None  # its per-parameter views (where dtypes match)

    def zeros(self, reuse: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A gradient sum of this shard, zeroed, and its per-parameter views.

        ``reuse``: the step's first computation sums into the buffer kept
        between steps (no fresh allocation per step); a recomputation after a
        failure gets a new one, since the first sum is still needed beside it.
        """
        device = self.params[0].device
        if not reuse:
            return self.views(torch.zeros(self.numel, dtype=self.grad_dtype, device=device))
        cached = self._sum
        if cached is None or cached[0].dtype != self.grad_dtype or cached[0].device != device:
            cached = self._sum = self.views(torch.empty(self.numel, dtype=self.grad_dtype, device=device))
        cached[0].zero_()
        return cached

    def views(self, total: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``total`` and its per-parameter views."""
        views, offset = [], 0
        for p in self.params:
            views.append(total[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return total, views

    def accumulate(self, views: list[torch.Tensor]) -> None:
        """Add the gradients in ``.grad`` that are not in the sum already to it, then clear ``.grad``."""
        for p, view in zip(self.params, views):
            grad = p.grad
            if grad is not None and grad.data_ptr() != view.data_ptr():  # (a bound .grad is the sum itself)
                view.add_(grad)  # in place into the sum's dtype: no temporary copies
            p.grad = None

    def bind(self, views: list[torch.Tensor]) -> bool:
        """Let autograd add each micro-batch's gradients straight into the sum: ``p.grad`` = its view.

        Only where the sum has the parameters' dtype (the default float32
        sums of float32 parameters; float64 sums cannot be a float32
        parameter's ``.grad``). Backward runs with grad mode off, so autograd
        adds into a ``.grad`` that exists in place (``grad += new``): the same
        sums, in the same order, as :meth:`accumulate` after each
        micro-batch, without a fresh gradient tensor per micro-batch and a
        Python pass over the parameters. A ``training_step`` must therefore
        not zero gradients in place (Lightning zeroes them itself, after the
        step's computation); one that sets them to None is harmless.

        Returns:
            Whether ``.grad`` are bound; else they are cleared (None) and each
            micro-batch is added by :meth:`accumulate`.
        """
        bound = all(view.dtype == p.dtype for p, view in zip(self.params, views))
        for p, view in zip(self.params, views):
            p.grad = view if bound else None
        return bound

    def release(self) -> None:
        """Clear ``.grad``: nothing keeps pointing into a sum (nor holds a failed micro-batch's part)."""
        for p in self.params:
            p.grad = None

    def reduce_buffer(self, local: torch.Tensor, slots: int) -> torch.Tensor:
        """Where the step's buckets are reduced: one buffer kept between steps, each bucket its own slice.

        Reducing a copy keeps ``local`` whole for a recomputation after a
        failure. The buffer is reused (no allocation and first-touch page
        faults per step), and bucket *k* is always reduced into slice *k*, so
        the buckets a failed attempt kept are not overwritten when the others
        are reduced again. ``slots`` elements follow the last bucket: the
        exchange's (:class:`~unicron_elastic.strategy.engine.exchange.ExchangeSlots`).
        """
        size = local.numel() + slots
        buf = self.reduced
        if buf is None or buf.numel() != size or buf.dtype != local.dtype or buf.device != local.device:
            buf = self.reduced = torch.empty(size, dtype=local.dtype, device=local.device)
            same = all(p.dtype == buf.dtype and p.device == buf.device for p in self.params)
            self._reduced_views = self.views(buf)[1] if same else None  # (else p.grad are copies: .to(p.dtype))
        return buf

    def reduced_sum(self) -> torch.Tensor | None:
        """The reduced gradient sum (the reduce buffer's head), or None before any reduction."""
        return None if self.reduced is None else self.reduced[: self.numel]

    def set_gradients(self, divisor: int, poisoned: bool) -> None:
        """``p.grad`` = the reduced sum / ``divisor``: views of the reduce buffer (copies only where dtypes differ).

        Every bucket was reduced in its slice of :meth:`reduce_buffer` (also a
        bucket kept from a failed attempt), so the sum is the buffer's head,
        already in place. ``poisoned``: another shard's sum overflowed; NaN
        makes the loss scaler skip the step here too.
        """
        grad = self.reduced_sum()
        assert grad is not None  # (every step reduces each of its buckets first)
        grad.div_(divisor)
        if poisoned:
            grad.fill_(float("nan"))
        if self._reduced_views is not None:  # the buffer's per-parameter views, made once
            for p, view in zip(self.params, self._reduced_views):
                p.grad = view
            return
        for p, view in zip(self.params, self.views(grad)[1]):
            p.grad = view.to(p.dtype)
