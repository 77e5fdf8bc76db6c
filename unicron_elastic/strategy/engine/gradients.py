"""One shard's gradient sums: the local sum of its micro-batches, the buffer its buckets are reduced in, ``p.grad``.

Gradients are summed over micro-batches (in ``grad_dtype``) and divided by B
once reduced, so the result does not depend on which rank computed which
micro-batch. The local sum stays whole while its buckets are reduced in a
copy: after a failure the survivors add the lost rank's micro-batches to it
and reduce again (:mod:`~unicron_elastic.strategy.engine.elastic_dp`).

A few *extra* elements may follow the gradients in the flat sum (``extras``):
what the step counts besides gradients (its token count and loss sum,
:mod:`~unicron_elastic.strategy.engine.step_totals`). They are summed, moved
and recomputed with the gradients, so each micro-batch enters them exactly
once, whoever computes it.

With megatron-core's gradient-accumulation fusion (``main_grad``), each
parameter's ``main_grad`` is its view of the sum (or, where the sum's dtype is
not float32, a float32 buffer added to the sum after each micro-batch):
megatron's fused weight-gradient kernel accumulates into it instead of ``.grad``.

With ``wire_dtype`` (bfloat16: Megatron-LM's ``--grad-reduce-in-bf16``) every
bucket but the last is all-reduced in that dtype (:meth:`GradientBuffer.wire`)
and its result widened back into the reduce buffer; the last bucket, which
holds the extras (and, without TP x PP, the exchange's slots), is reduced in
``grad_dtype``, exactly. The local sums stay in ``grad_dtype``.

With a sharded optimizer (``half_main_grads``), a half-precision parameter's
reduced gradient is not rounded to its dtype: its ``.grad`` stays None and its
``main_grad`` is its view of the reduced sum, which the optimizer's float32
main parameters load (:func:`optimizer_gradient`), as megatron-core's
distributed optimizer loads ``main_grad``.

Reduce-scattered (the distributed optimizer with one instance, ``reduce_scatter``),
each bucket's reduced sum reaches only the rank whose share of the flat sum
holds it: the reduce buffer is that share (:attr:`GradientBuffer.scatter`),
and no parameter gets a ``.grad``; the optimizer's shares load from it.
"""

from __future__ import annotations

import itertools

import torch

from unicron_elastic.api import ConfigError

#: Parameter dtypes a sharded optimizer keeps float32 main parameters of (Megatron-LM's mixed precision).
HALF = (torch.bfloat16, torch.float16)


def optimizer_gradient(param: torch.nn.Parameter) -> torch.Tensor | None:
    """A parameter's reduced gradient as a sharded optimizer loads and clips it: ``main_grad`` for a half-precision
    parameter (the reduced sum's own dtype, see :class:`GradientBuffer`), else ``.grad``."""
    if param.dtype in HALF:
        return getattr(param, "main_grad", None)
    return param.grad


def scale_to_norm(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale ``grads`` in place by ``min(max_norm / (total_norm + 1e-6), 1)``: torch's
    ``clip_grads_with_norm_`` on gradient tensors themselves (the same operations, so the same bits)."""
    coefficient = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.device))


class GradientBuffer:
    """The gradient sums of ``params``, bucket by bucket.

    Args:
        params: The parameters that require a gradient (this rank's shard).
        grad_dtype: Dtype of the sums and of their all-reduce.
        bucket_numel: Elements per bucket (None: one bucket).
        extras: Elements after the gradients in the flat sum (in the last bucket).
        main_grad: Give every parameter a ``main_grad`` (megatron-core's gradient-accumulation fusion).
        half_main_grads: (A sharded optimizer) a half-precision parameter's reduced gradient is its ``main_grad``,
            a view of the reduced sum, and its ``.grad`` stays None (:meth:`set_gradients`).
        wire_dtype: The dtype every bucket but the last is all-reduced in (None: ``grad_dtype``).

    Raises:
        ConfigError: ``params`` is empty.
    """

    def __init__(self, params: list[torch.nn.Parameter], grad_dtype: torch.dtype, bucket_numel: int | None,
                 extras: int = 0, main_grad: bool = False, half_main_grads: bool = False,
                 wire_dtype: torch.dtype | None = None) -> None:
        if not params:
            raise ConfigError("the model has no parameter that requires a gradient")
        self.params, self.grad_dtype = params, grad_dtype
        #: Gradient elements (the extras follow them).
        self.numel = sum(p.numel() for p in params)
        self.extras, self.main_grad, self.half_main_grads = extras, main_grad, half_main_grads
        self.wire_dtype = wire_dtype if wire_dtype != grad_dtype else None
        self._wire: torch.Tensor | None = None  # the buckets before the last, in wire_dtype (reused)
        total = self.numel + extras
        size = bucket_numel or total
        #: ``(start, end)`` of each bucket in the flat sum (the last one holds the extras).
        self.bounds = [(start, min(start + size, total)) for start in range(0, total, size)]
        self._scratch: list[torch.Tensor] | None = None  # float32 main_grad buffers where the sum is not float32
        self._sum: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # the step's local sum (reused)
        #: Where the step's buckets are reduced (reused; see :meth:`reduce_buffer`).
        self.reduced: torch.Tensor | None = None
        self._reduced_views: list[torch.Tensor] | None = None  # its per-parameter views (where dtypes match)
        #: Reduce-scattered: the ``(start, end)`` of the gradients this rank receives reduced (its share); None:
        #: all-reduced. Set by the reduction for each step's layout.
        self.scatter: tuple[int, int] | None = None

    def zeros(self, reuse: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A gradient sum of this shard, zeroed, and its per-parameter views.

        ``reuse``: the step's first computation sums into the buffer kept
        between steps (no fresh allocation per step); a recomputation after a
        failure gets a new one, since the first sum is still needed beside it.
        """
        device = self.params[0].device
        size = self.numel + self.extras
        if not reuse:
            return self.views(torch.zeros(size, dtype=self.grad_dtype, device=device))
        cached = self._sum
        if cached is None or cached[0].dtype != self.grad_dtype or cached[0].device != device:
            cached = self._sum = self.views(torch.empty(size, dtype=self.grad_dtype, device=device))
        cached[0].zero_()
        return cached

    def kept(self) -> list[torch.Tensor]:
        """The buffers kept between steps: the local sum, the reduce buffer, the wire buffer and megatron's
        float32 ``main_grad`` buffers (those made so far)."""
        kept = [self._sum[0]] if self._sum is not None else []
        return kept + [t for t in (self.reduced, self._wire) if t is not None] + list(self._scratch or [])

    def spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each parameter's gradient in the flat sum, in the order of :attr:`params`."""
        ends = itertools.accumulate(p.numel() for p in self.params)
        return [(end - p.numel(), end) for p, end in zip(self.params, ends)]

    def extras_of(self, total: torch.Tensor) -> torch.Tensor:
        """The extra elements of a flat sum (a view: adding to it adds to the sum)."""
        return total[self.numel : self.numel + self.extras]

    def views(self, total: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``total`` and its per-parameter views (the gradients only)."""
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
        if self._scratch is not None:  # what megatron's fused kernel accumulated since the last call
            for view, scratch in zip(views, self._scratch):
                view.add_(scratch)
                scratch.zero_()

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
        if self.main_grad:
            self._bind_main_grad(views)
        return bound

    def _bind_main_grad(self, views: list[torch.Tensor]) -> None:
        """``main_grad`` of every parameter: its view of the sum when the sum is float32, else a zeroed float32
        buffer that :meth:`accumulate` adds to the sum (megatron's fused kernel accumulates in float32)."""
        if all(view.dtype == torch.float32 for view in views):
            self._scratch = None
            for p, view in zip(self.params, views):
                p.main_grad = view
            return
        if self._scratch is None:
            self._scratch = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in self.params]
        for p, scratch in zip(self.params, self._scratch):
            scratch.zero_()
            p.main_grad = scratch

    def release(self) -> None:
        """Clear ``.grad`` (and ``main_grad``): nothing keeps pointing into a sum (nor holds a failed
        micro-batch's part)."""
        for p in self.params:
            p.grad = None
            if (self.main_grad or self.half_main_grads) and hasattr(p, "main_grad"):
                del p.main_grad

    def reduce_buffer(self, local: torch.Tensor, slots: int) -> torch.Tensor:
        """Where the step's buckets are reduced: one buffer kept between steps, each bucket its own slice.

        Reducing a copy keeps ``local`` whole for a recomputation after a
        failure. The buffer is reused (no allocation and first-touch page
        faults per step), and bucket *k* is always reduced into slice *k*, so
        the buckets a failed attempt kept are not overwritten when the others
        are reduced again. ``slots`` elements follow the last bucket: the
        exchange's (:class:`~unicron_elastic.strategy.engine.exchange.ExchangeSlots`).

        Reduce-scattered (:attr:`scatter`), the buffer holds this rank's share
        of the gradients, then the extras and the slots (all-reduced).
        """
        size = self.head + self.extras + slots
        buf = self.reduced
        if buf is None or buf.numel() != size or buf.dtype != local.dtype or buf.device != local.device:
            buf = self.reduced = torch.empty(size, dtype=local.dtype, device=local.device)
            same = self.scatter is None and all(p.dtype == buf.dtype and p.device == buf.device for p in self.params)
            self._reduced_views = self.views(buf)[1] if same else None  # (else p.grad are copies: .to(p.dtype))
        return buf

    @property
    def head(self) -> int:
        """Gradient elements of the reduce buffer: all of them, or this rank's share when reduce-scattered."""
        return self.numel if self.scatter is None else self.scatter[1] - self.scatter[0]

    def wire(self, bucket: int, local: torch.Tensor) -> torch.Tensor | None:
        """Where ``bucket`` is all-reduced when it travels in :attr:`wire_dtype` (its slice of a buffer kept
        between steps), else None: the last bucket, or no ``wire_dtype``."""
        if self.wire_dtype is None or bucket == len(self.bounds) - 1:
            return None
        size = self.bounds[-1][0]  # (every bucket before the last)
        buf = self._wire
        if buf is None or buf.numel() != size or buf.dtype != self.wire_dtype or buf.device != local.device:
            buf = self._wire = torch.empty(size, dtype=self.wire_dtype, device=local.device)
        start, end = self.bounds[bucket]
        return buf[start:end]

    def reduced_sum(self) -> torch.Tensor | None:
        """The reduced gradient sum (the reduce buffer's head), or None before any reduction."""
        return None if self.reduced is None else self.reduced[: self.head]

    def reduced_extras(self) -> torch.Tensor | None:
        """The reduced extra elements (after the gradients), or None before any reduction."""
        return None if self.reduced is None else self.reduced[self.head : self.head + self.extras]

    def set_gradients(self, divisor: float, poisoned: bool) -> None:
        """``p.grad`` = the reduced sum / ``divisor``: views of the reduce buffer (copies only where dtypes differ).

        Every bucket was reduced in its slice of :meth:`reduce_buffer` (also a
        bucket kept from a failed attempt), so the sum is the buffer's head,
        already in place. ``poisoned``: another shard's sum overflowed; NaN
        makes the loss scaler skip the step here too. With
        ``half_main_grads`` a half-precision parameter's gradient is its
        ``main_grad`` (a view, not rounded) and its ``.grad`` None.
        Reduce-scattered (:attr:`scatter`) no parameter gets a gradient: the
        sharded optimizer loads its share from the buffer.
        """
        grad = self.reduced_sum()
        assert grad is not None  # (every step reduces each of its buckets first)
        grad.div_(divisor)
        if poisoned:
            grad.fill_(float("nan"))
        if self.scatter is not None:  # the share is the sharded optimizer's to load: no parameter has a gradient
            self.release()
            return
        if self._reduced_views is not None:  # the buffer's per-parameter views, made once
            for p, view in zip(self.params, self._reduced_views):
                p.grad = view
            return
        for p, view in zip(self.params, self.views(grad)[1]):
            if self.half_main_grads and p.dtype in HALF:
                p.grad, p.main_grad = None, view
            else:
                p.grad = view.to(p.dtype)
