"""unicron_elastic: self-healing, cost-aware distributed LLM training.

Plugs into torchrun (``--rdzv-backend=unicron`` and the ``unicron-run``
launcher), PyTorch Lightning and megatron-core. See README.md and DESIGN.md.
"""

__version__ = "0.1.0"


def _register_lightning_strategy() -> None:
    """Register ``unicron_megatron`` if Lightning is already imported (it costs ~2 s to import it here)."""
    import sys

    if "lightning.pytorch" in sys.modules:
        import unicron_elastic.strategy  # noqa: F401  (registers on import)


_register_lightning_strategy()
