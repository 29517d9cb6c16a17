"""Reverse-mode autodiff on an (optimized) forward graph.

``gradients`` holds the gradient table, one row per op, and ``differentiate``. Imports
``engine.graph`` and ``engine.errors`` only.
"""

from .gradients import GRADIENTS, differentiate

__all__ = ["GRADIENTS", "differentiate"]
