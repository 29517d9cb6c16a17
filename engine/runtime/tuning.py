"""The adapter's kernel tuning as plans read it: ``meganeura tune``'s winners from the
per-adapter cache (engine/runtime/adapter_cache.py, kind "tuning"), else the defaults of
``engine.codegen.tuning``. Measuring them is engine/runtime/tuner.py's job.
"""

from __future__ import annotations

from ..codegen.tuning import Tuning
from .adapter_cache import adapter_key, read_measurement, write_measurement

TUNING_FORMAT = 1


def tuning_key(info: dict) -> dict:
    """What a tuning of ``info``'s adapter (an ``adapter_info()``) is valid for."""
    return adapter_key(info, TUNING_FORMAT)


def _valid(payload) -> bool:
    try:
        Tuning.from_dict(payload["tuning"])
    except (TypeError, KeyError, ValueError):
        return False
    return True


def read_tuning(key: dict, cache_dir=None) -> dict | None:
    """The stored tuning run for ``key`` (``tuning``, ``measurements``, when and how), or None."""
    return read_measurement("tuning", key, cache_dir, _valid)


def write_tuning(key: dict, result: dict, cache_dir=None):
    """Store a tuning run under ``key`` (written to a temp file and renamed)."""
    return write_measurement("tuning", key, result, cache_dir)


def adapter_tuning(info: dict, cache_dir=None) -> Tuning:
    """The tuning plans for ``info``'s adapter are compiled with: its cached winners, else the defaults."""
    stored = read_tuning(tuning_key(info), cache_dir)
    return Tuning.from_dict(stored["tuning"]) if stored is not None else Tuning()
