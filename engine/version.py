"""The engine's version: part of every plan-cache key, so a new release never reads an old plan."""

__version__ = "0.1.0"
