"""The unicron agent: one per node, a subclass of torchrun's ``LocalElasticAgent``."""

from unicron_elastic.agent.agent import UnicronAgent

__all__ = ["UnicronAgent"]
