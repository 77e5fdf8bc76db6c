"""unicron_elastic: self-healing, cost-aware distributed LLM training.

Plugs into torchrun (``--rdzv-backend=unicron`` and the ``unicron-run``
launcher), PyTorch Lightning and megatron-core. See README.md and DESIGN.md.
"""

__version__ = "0.2.0"


def _register_lightning_strategy() -> None:
    """Register ``unicron_megatron`` with Lightning, now or when it is imported (never importing it here: ~2 s)."""
    from unicron_elastic._lightning_hook import install

    install()


_register_lightning_strategy()
