"""A CPU stand-in of Apex's ``fused_weight_gradient_mlp_cuda`` kernel (gradient-accumulation fusion).

megatron-core's linear layers, with ``gradient_accumulation_fusion=True``, call
``wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)`` instead of
returning the weight's gradient: the kernel adds ``grad_output^T @ total_input``
into ``main_grad``. This module does the same arithmetic on any device, so a CPU
test runs megatron-core's fused path (the strategy must give every weight a
``main_grad`` backed by its gradient sum). A test puts this folder on
``PYTHONPATH``; production code never imports it.
"""

from __future__ import annotations

import torch


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` (``main_grad`` float32)."""
    if main_grad.dtype != torch.float32:
        raise TypeError(f"wgrad_gemm_accum_fp32: main_grad is {main_grad.dtype}, not float32")
    main_grad.add_(grad_output.t().matmul(total_input))


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` (``main_grad`` float16 or bfloat16)."""
    main_grad.add_(grad_output.t().matmul(total_input).to(main_grad.dtype))
