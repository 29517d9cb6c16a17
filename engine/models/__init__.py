"""The built-in models, by name.

``get(name)`` returns a model class; ``get(name)(batch=8)`` or
``get(name).from_overrides(["batch=8"])`` configures one (settings are checked).
``names()`` lists them. See ``base.BuiltinModel`` for what a model provides.
"""

from __future__ import annotations

from ..errors import UnknownModelError
from .audio_align import AudioAlign
from .base import BuiltinModel, Setting, parse_overrides
from .gpt import GPTTiny
from .mlp import MLPModel
from .whisper import WhisperTiny

REGISTRY: dict[str, type[BuiltinModel]] = {cls.name: cls for cls in (MLPModel, WhisperTiny, GPTTiny, AudioAlign)}


def names() -> list[str]:
    return list(REGISTRY)


def get(name: str) -> type[BuiltinModel]:
    """The model class registered as ``name``."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownModelError(f"no built-in model named {name!r}; known models: {', '.join(REGISTRY)}") from None


def create(name: str, overrides=(), **settings) -> BuiltinModel:
    """A configured model: ``create("whisper-tiny", ["mel_len=500"])``."""
    return get(name)(**{**parse_overrides(overrides), **settings})


__all__ = ["BuiltinModel", "Setting", "REGISTRY", "names", "get", "create", "parse_overrides"]
