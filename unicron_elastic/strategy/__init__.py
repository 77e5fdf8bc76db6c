"""The ``unicron_megatron`` Lightning strategy (strategy issue)."""
