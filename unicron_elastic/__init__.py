"""unicron_elastic: self-healing, cost-aware distributed LLM training.

Plugs into torchrun (``--rdzv-backend=unicron`` and the ``unicron-run``
launcher), PyTorch Lightning and megatron-core. See README.md and DESIGN.md.
"""

__version__ = "0.1.0"
