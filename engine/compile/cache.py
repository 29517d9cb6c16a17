"""The on-disk plan cache: a compiled ``ExecutionPlan`` keyed by the graph, the gradients,
the capabilities and a fingerprint of everything that writes kernels, written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

import platformdirs

from .. import codegen
from ..config import Config, current
from ..graph.ir import Graph
from ..paths import shader_dir
from ..version import __version__
from .plan import ExecutionPlan, OptimizerSpec, capabilities_dict, compile_plan


# ---------------------------------------------------------------- the on-disk cache

def default_cache_dir(config: Config | None = None) -> Path:
    """``MEGANEURA_CACHE``/plans, else the user cache folder's (platformdirs)."""
    base = (config or current()).cache_dir or platformdirs.user_cache_dir("meganeura", appauthor=False)
    return Path(base) / "plans"


@lru_cache(maxsize=None)
def _codegen_fingerprint() -> str:
    """A hash of what writes a plan's kernels (codegen, this package, the WGSL
    templates): a cached plan holds generated WGSL, so editing any of them must miss."""
    h = hashlib.sha256()
    sources = [*sorted(Path(codegen.__file__).parent.glob("*.py")), *sorted(Path(__file__).parent.glob("*.py"))]
    for path in sources + sorted(shader_dir().glob("*.wgsl")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _cache_key(graph: Graph, gradients, loss, capabilities: codegen.Capabilities,
               optimizer: OptimizerSpec | None) -> str:
    # the capabilities hold the knobs, which force kernel variants at codegen time; the
    # nodes' modules name the plan's dispatches (the structural hash leaves them out)
    key = json.dumps([graph.structural_hash(), sorted((gradients or {}).items()), loss, asdict(capabilities),
                      optimizer.to_dict() if optimizer is not None else None, _codegen_fingerprint(),
                      [(n.id, n.modules) for n in graph.nodes if n.modules]], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def cached_plan(graph: Graph, gradients: dict[str, str] | None = None, loss: str | None = "loss",
                cache_dir: Path | None = None, capabilities: codegen.Capabilities = codegen.PLAIN,
                optimizer: OptimizerSpec | None = None) -> ExecutionPlan:
    """``compile_plan`` through an on-disk cache keyed by graph hash, the nodes' modules,
    gradients, loss, capabilities, optimizer, the code that generates kernels and the engine version.
    A stale or unreadable entry is ignored with a warning and rewritten."""
    cache_dir = Path(cache_dir or default_cache_dir())
    path = cache_dir / f"{_cache_key(graph, gradients, loss, capabilities, optimizer)}-v{__version__}.json"
    if path.exists():
        try:
            plan = ExecutionPlan.from_dict(json.loads(path.read_text()))
            if (plan.graph_hash == graph.structural_hash() and plan.engine_version == __version__
                    and plan.capabilities == capabilities_dict(capabilities)):
                return plan
            warnings.warn(f"plan cache {path} is stale; rebuilding it")
        except (ValueError, TypeError, KeyError, OSError) as e:
            warnings.warn(f"plan cache {path} is unreadable ({type(e).__name__}: {e}); rebuilding it")
    plan = compile_plan(graph, gradients, loss, capabilities, optimizer)
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(plan.to_json())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return plan
