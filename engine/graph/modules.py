"""Module paths (``model.layers.3.self_attn``): how graphs, plans and profiles group
what they hold by the module it came from.

A node's modules are stamped when it is built (``Graph.scope``); fusion, autodiff and
the plan keep them. This module answers the questions every consumer asks of those
paths: which module is a path's parent, which modules a model *opens* into by default
(its "blocks": the numbered layers and the modules beside them, so a 30-layer Llama
reads as ``model.embed_tokens``, ``model.layers.0`` … ``model.layers.29``,
``model.norm``, ``lm_head``), and which block a path falls in. The CLI's
``profile --group-by module``, the ``modules`` list of ``profile --json``, the Studio's
kernel table and its graph view all group by these blocks.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

TOP_LEVEL = "(top level)"          # what a row of things outside every module is called
OPTIMIZER_STEP = "(optimizer step)"  # the module of a training step's gradient copies, norm and updates


def parent_of(path: str) -> str:
    """``model.layers`` for ``model.layers.3``; '' for a top-level module."""
    return path.rpartition(".")[0]


def ancestors(path: str) -> list[str]:
    """The modules holding ``path``, outermost first, '' (the top level) included."""
    if not path:
        return []
    parts = path.split(".")
    return [""] + [".".join(parts[:k]) for k in range(1, len(parts))]


def is_numbered(path: str) -> bool:
    """An entry of a module list (``layers.3``)."""
    return path.rpartition(".")[2].isdigit()


def containers(paths: Iterable[str]) -> set[str]:
    """The modules a model opens into by default: the top level, and every module that
    holds a numbered module (``model``, ``model.layers``) - the layer lists and what
    leads to them. Everything else starts closed."""
    opened = {""}
    for path in set(paths):
        parts = path.split(".") if path else []
        for k in range(len(parts)):          # the outermost list: its entries are the blocks
            if parts[k].isdigit():
                opened.update(".".join(parts[:j]) for j in range(1, k + 1))
                break
    return opened


def block_of(path: str, opened: set[str]) -> str:
    """The first module on the way down to ``path`` that is not opened (the box or
    table row ``path`` is counted in); ``path`` itself where all of it is opened."""
    if not path:
        return ""
    parts = path.split(".")
    for k in range(1, len(parts) + 1):
        prefix = ".".join(parts[:k])
        if prefix not in opened:
            return prefix
    return path


def pattern_of(path: str) -> str:
    """The path with list indices as ``*`` (``model.layers.*.mlp``): the same module of every layer."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", path)


def describe(counts: dict[str, int] | Iterable[str], most: int = 3) -> str:
    """A short line saying where things are: ``model.layers.*.mlp ×30, lm_head``."""
    if not isinstance(counts, dict):
        counts = Counter(counts)
    by_pattern: Counter = Counter()
    for path, n in counts.items():
        by_pattern[pattern_of(path) or TOP_LEVEL] += n
    parts = [f"{p} ×{n}" if n > 1 else p for p, n in by_pattern.most_common(most)]
    if len(by_pattern) > most:
        parts.append(f"+{len(by_pattern) - most} more")
    return ", ".join(parts)
