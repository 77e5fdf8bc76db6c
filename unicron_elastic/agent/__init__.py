"""The unicron agent: one per node, a subclass of torchrun's ``LocalElasticAgent``.

``UnicronAgent`` is imported on first use, so that the warm pool's zygote (``agent.warm``) imports
none of the agent, nor torch, unless it is told to preload them.
"""

from unicron_elastic._lazy import lazy_exports

__all__ = ["UnicronAgent"]
__getattr__ = lazy_exports(__name__, {"UnicronAgent": "agent"})
