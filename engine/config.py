"""The process's configuration: every ``MEGANEURA_*`` environment variable, read once.

``current()`` reads the environment the first time it is asked and keeps the result, a
frozen ``Config``; entry points (the CLI, the Studio, the public builders) take it there
and pass it down: ``Capabilities`` carries its kernel ``Knobs`` into codegen and the plan
cache key, the device layer its backend and shader checks. ``use(config)`` replaces it
(the CLI's ``--precision``, tests). docs/cli.md has the table of variables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Mapping

from .errors import MeganeuraError

BACKENDS = ("native", "dawn")
PRECISIONS = ("f32", "f16")
SHADER_CHECKS = ("checked", "no-loop-bounding", "unchecked")
ATTENTION_KERNELS = ("auto", "tiled", "per-query")


class ConfigError(MeganeuraError):
    """A ``MEGANEURA_*`` variable has a value the engine does not know."""


@dataclass(frozen=True)
class Knobs:
    """Kernel and plan choices forced for benchmarks and tests; 0 or "" leaves a choice to
    the engine's rules. Part of every plan's capabilities, so of its cache key."""

    matmul: str = "auto"              # MEGANEURA_MATMUL: one of codegen's MATMUL_KERNELS
    matmul_splits: int = 0            # MEGANEURA_MATMUL_SPLITS
    attention: str = "auto"           # MEGANEURA_ATTENTION: auto | tiled (no cooperative) | per-query
    attention_splits: int = 0         # MEGANEURA_ATTENTION_SPLITS
    attention_backward_rows: int = 0  # MEGANEURA_ATTENTION_BACKWARD_ROWS: 16 | 32 | 64
    attention_backward_block: int = 0  # MEGANEURA_ATTENTION_BACKWARD_BLOCK: 32 | 64 (cooperative backward)
    attention_prefetch: int = 2       # MEGANEURA_ATTENTION_PREFETCH: 0 | 1 | 2
    attention_backward: str = "auto"  # MEGANEURA_ATTENTION_BACKWARD: auto | f32 (no cooperative backward)
    attention_dq: str = "auto"        # MEGANEURA_ATTENTION_DQ: auto | kernel (no dq as the product of dkdv's dS)
    thread_layout: str = ""           # MEGANEURA_THREAD_LAYOUT: rows | warp
    pool: bool = True                 # MEGANEURA_POOL=0: every tensor its own buffer
    bf16_weights: bool = True         # MEGANEURA_BF16_WEIGHTS=0: generation keeps bf16 checkpoints' weights in f32
    weight_layout: str = "out-in"     # MEGANEURA_WEIGHT_LAYOUT=in-out: generation keeps linear weights [in, out]
    decode_folds: bool = True         # MEGANEURA_DECODE_FOLDS=0: a decode step's cache write, combine, argmax apart


@dataclass(frozen=True)
class Config:
    wgpu: str = "native"               # MEGANEURA_WGPU: native | dawn
    precision: str = "f32"             # MEGANEURA_PRECISION: f32 | f16
    cache_dir: str | None = None       # MEGANEURA_CACHE: plan cache folder
    trace: str | None = None           # MEGANEURA_TRACE: write the last profile there at exit
    shader_checks: str | None = None   # MEGANEURA_SHADER_CHECKS
    studio_settings: str | None = None  # MEGANEURA_STUDIO_SETTINGS: an ini file instead of the user's
    runs_dir: str | None = None        # MEGANEURA_RUNS: where new run directories go (default runs/ here)
    knobs: Knobs = field(default_factory=Knobs)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Config":
        """The configuration ``environ`` describes; a bad value is a ``ConfigError``."""
        get = lambda name: environ.get(f"MEGANEURA_{name}") or None
        knobs = Knobs(
            matmul=get("MATMUL") or "auto",
            matmul_splits=_count(get, "MATMUL_SPLITS"),
            attention=_choice(get, "ATTENTION", ATTENTION_KERNELS, "auto"),
            attention_splits=_count(get, "ATTENTION_SPLITS"),
            attention_backward_rows=int(_choice(get, "ATTENTION_BACKWARD_ROWS", ("16", "32", "64"), "0")),
            attention_backward_block=int(_choice(get, "ATTENTION_BACKWARD_BLOCK", ("32", "64"), "0")),
            attention_prefetch=int(_choice(get, "ATTENTION_PREFETCH", ("0", "1", "2"), "2")),
            attention_backward=_choice(get, "ATTENTION_BACKWARD", ("auto", "f32"), "auto"),
            attention_dq=_choice(get, "ATTENTION_DQ", ("auto", "kernel"), "auto"),
            thread_layout=get("THREAD_LAYOUT") or "",
            pool=_choice(get, "POOL", ("0", "1"), "1") == "1",
            bf16_weights=_choice(get, "BF16_WEIGHTS", ("0", "1"), "1") == "1",
            weight_layout=_choice(get, "WEIGHT_LAYOUT", ("out-in", "in-out"), "out-in"),
            decode_folds=_choice(get, "DECODE_FOLDS", ("0", "1"), "1") == "1",
        )
        return cls(wgpu=_choice(get, "WGPU", BACKENDS, "native"),
                   precision=_choice(get, "PRECISION", PRECISIONS, "f32"),
                   cache_dir=get("CACHE"), trace=get("TRACE"),
                   shader_checks=_choice(get, "SHADER_CHECKS", SHADER_CHECKS, None),
                   studio_settings=get("STUDIO_SETTINGS"), runs_dir=get("RUNS"), knobs=knobs)

    def with_knobs(self, **changes) -> "Config":
        return replace(self, knobs=replace(self.knobs, **changes))


def _choice(get, name: str, allowed, default):
    value = get(name)
    if value is None:
        return default
    if value not in allowed:
        raise ConfigError(f"MEGANEURA_{name}={value!r} is not one of {', '.join(allowed)}")
    return value


def _count(get, name: str) -> int:
    value = get(name)
    if value is None:
        return 0
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"MEGANEURA_{name}={value!r} is not a positive whole number")
    return int(value)


_current: Config | None = None


def current() -> Config:
    """The process's configuration, read from the environment on first use."""
    global _current
    if _current is None:
        _current = Config.from_env()
    return _current


def use(config: Config | None) -> Config | None:
    """Make ``config`` the process's configuration (None: read the environment again on
    next use); returns the previous one."""
    global _current
    previous, _current = _current, config
    return previous
