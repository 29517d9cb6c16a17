"""The on-disk caches of a session's build, so that a second process building the same
model skips the work: the optimized graphs (``optimize``, and for training ``differentiate``
and ``optimize`` again; egglog is not even imported on a hit) and the compiled
``ExecutionPlan``. Each entry is a JSON file keyed by its input, a fingerprint of the code
that made it and the engine version, written to a temp file and renamed. A stale or
unreadable entry is ignored with a warning and rewritten; a folder that cannot be written
is a warning, never an error.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Callable

import platformdirs

from .. import codegen
from ..config import Config, current
from ..errors import MeganeuraError, MeganeuraWarning, OutputError
from ..files import write_atomically
from ..graph.ir import Graph
from ..paths import shader_dir
from ..version import __version__
from .plan import ExecutionPlan, OptimizerSpec, capabilities_dict, compile_plan

ENGINE_DIR = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- the on-disk cache

def cache_root(config: Config | None = None) -> Path:
    """``MEGANEURA_CACHE``, else the user cache folder (platformdirs): each cache has a folder in it."""
    return Path((config or current()).cache_dir or platformdirs.user_cache_dir("meganeura", appauthor=False))


def default_cache_dir(config: Config | None = None) -> Path:
    """The plan cache's folder: ``plans`` in ``cache_root()``."""
    return cache_root(config) / "plans"


def graphs_cache_dir(config: Config | None = None) -> Path:
    """The optimized-graph cache's folder: ``graphs`` in ``cache_root()``."""
    return cache_root(config) / "graphs"


def _fingerprint(paths) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@lru_cache(maxsize=None)
def _codegen_fingerprint() -> str:
    """A hash of what writes a plan's kernels (codegen, this package, the WGSL
    templates): a cached plan holds generated WGSL, so editing any of them must miss."""
    return _fingerprint([*sorted(Path(codegen.__file__).parent.glob("*.py")),
                         *sorted(Path(__file__).parent.glob("*.py")), *sorted(shader_dir().glob("*.wgsl"))])


@lru_cache(maxsize=None)
def _rules_fingerprint() -> str:
    """A hash of what turns a graph into the optimized one (the fusion rules and their
    pass, autodiff, the op table's shape and gradient rules) and of egglog's version."""
    sources = [p for folder in ("optimize", "autodiff", "graph") for p in sorted((ENGINE_DIR / folder).rglob("*.py"))]
    try:
        egglog = metadata.version("egglog")
    except metadata.PackageNotFoundError:
        egglog = None
    return f"{_fingerprint(sources)}-{egglog}"


# ---------------------------------------------------------------- entries

class StaleEntry(ValueError):
    """An entry written for another input or engine than its key says."""

    def __init__(self):
        super().__init__("stale")


def read_entry(path: Path, what: str, decode: Callable[[object], object]):
    """``decode`` of the JSON at ``path``; None when there is none, or (with a warning)
    when it is unreadable or ``decode`` raises StaleEntry."""
    if not path.exists():
        return None
    try:
        return decode(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError, OSError, MeganeuraError) as e:
        reason = str(e) if isinstance(e, StaleEntry) else f"unreadable ({type(e).__name__}: {e})"
        warnings.warn(f"{what} cache {path} is {reason}; rebuilding it", MeganeuraWarning)
        return None


def write_entry(path: Path, text: str, what: str) -> None:
    """Write ``text`` whole beside ``path``'s older entry; a folder that cannot be written
    is a warning (the build goes on, uncached)."""
    try:
        write_atomically(path, text, make_parents=True)
    except OutputError as e:
        warnings.warn(f"cannot write the {what} cache in {path.parent} ({e}); going on without it", MeganeuraWarning)


def _cache_key(graph: Graph, gradients, loss, capabilities: codegen.Capabilities,
               optimizer: OptimizerSpec | None, pack_parameters: bool = True) -> str:
    # the capabilities hold the knobs, which force kernel variants at codegen time; the
    # nodes' modules name the plan's dispatches (the structural hash leaves them out)
    key = json.dumps([graph.structural_hash(), sorted((gradients or {}).items()), loss, asdict(capabilities),
                      optimizer.to_dict() if optimizer is not None else None, _codegen_fingerprint(),
                      [(n.id, n.modules) for n in graph.nodes if n.modules], pack_parameters], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def cached_plan(graph: Graph, gradients: dict[str, str] | None = None, loss: str | None = "loss",
                cache_dir: Path | None = None, capabilities: codegen.Capabilities = codegen.PLAIN,
                optimizer: OptimizerSpec | None = None, pack_parameters: bool = True) -> ExecutionPlan:
    """``compile_plan`` through an on-disk cache keyed by graph hash, the nodes' modules,
    gradients, loss, capabilities, optimizer, ``pack_parameters``, the code that generates
    kernels and the engine version.
    A stale or unreadable entry is ignored with a warning and rewritten."""
    path = Path(cache_dir or default_cache_dir()) / \
        f"{_cache_key(graph, gradients, loss, capabilities, optimizer, pack_parameters)}-v{__version__}.json"

    def decode(d: dict) -> ExecutionPlan:
        plan = ExecutionPlan.from_dict(d)
        if (plan.graph_hash != graph.structural_hash() or plan.engine_version != __version__
                or plan.capabilities != capabilities_dict(capabilities)):
            raise StaleEntry()
        return plan

    plan = read_entry(path, "plan", decode)
    if plan is None:
        plan = compile_plan(graph, gradients, loss, capabilities, optimizer, pack_parameters)
        write_entry(path, plan.to_json(), "plan")
    return plan


# ---------------------------------------------------------------- optimized graphs

def cached_optimize(graph: Graph, cache_dir: Path | None = None):
    """``engine.optimize(graph)`` and the inference passes (``engine.optimize.passes``) ->
    (fused graph, OptimizeReport), through the on-disk cache."""
    def build():
        from ..optimize.passes import optimize_inference
        out, report = optimize_inference(graph)
        return out, [], [report]
    out, _, (report,) = _cached_graphs("forward", graph, None, build, cache_dir)
    return out, report


def cached_generation_graph(graph: Graph, cache_dir: Path | None = None):
    """``engine.optimize.passes.optimize_generation(graph)`` -> (fused graph, OptimizeReport),
    through the on-disk cache: a second ``generate`` of a model skips egglog (its import too)."""
    def build():
        from ..optimize.passes import optimize_generation
        out, report, _ = optimize_generation(graph)
        return out, [], [report]
    out, _, (report,) = _cached_graphs("generation", graph, None, build, cache_dir)
    return out, report


def cached_training_graph(forward: Graph, loss: str, cache_dir: Path | None = None):
    """The training pipeline of DESIGN.md on a forward graph (its frozen parameters
    marked): ``optimize`` it, ``differentiate`` it for ``loss`` and ``optimize`` the
    result, through the on-disk cache. Returns (training graph, [(parameter, gradient
    output)], forward OptimizeReport, training-graph OptimizeReport)."""
    def build():
        from ..autodiff.gradients import differentiate
        from ..optimize import optimize
        from ..optimize.passes import TRAINING, run_passes
        fused, forward_report = optimize(forward)
        train_graph, pairs = differentiate(fused, loss)
        train_graph, training_report = optimize(train_graph)
        train_graph, _ = run_passes(train_graph, TRAINING, report=training_report)
        return train_graph, pairs, [forward_report, training_report]
    out, pairs, (forward_report, training_report) = _cached_graphs("training", forward, loss, build, cache_dir)
    return out, pairs, forward_report, training_report


def _graphs_key(graph: Graph, loss: str | None) -> str:
    # the structural hash leaves out the graph's name and its nodes' modules, which the result carries
    key = json.dumps([graph.structural_hash(), graph.name, [(n.id, n.modules) for n in graph.nodes if n.modules],
                      loss, _rules_fingerprint()])
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _cached_graphs(kind: str, graph: Graph, loss: str | None, build, cache_dir: Path | None):
    """(graph, pairs, reports) as ``build()`` makes them, read from the cache when an
    entry for ``graph`` is there. A result cut short by the optimizer's time limit is not
    cached (another run may get further), nor one whose JSON does not give it back exactly."""
    from ..optimize.report import OptimizeReport
    path = Path(cache_dir or graphs_cache_dir()) / f"{kind}-{_graphs_key(graph, loss)}-v{__version__}.json"
    input_hash = graph.structural_hash()

    def decode(d: dict):
        if d["input_hash"] != input_hash or d["engine_version"] != __version__ or d["loss"] != loss:
            raise StaleEntry()
        out = Graph.from_dict(d["graph"])
        if out.structural_hash() != d["graph_hash"]:
            raise StaleEntry()
        return out, [tuple(p) for p in d["pairs"]], [OptimizeReport.from_dict(r) for r in d["reports"]]

    hit = read_entry(path, "optimized graph", decode)
    if hit is not None:
        return hit
    out, pairs, reports = build()
    if all(r.stop_reason != "time_limit" for r in reports):
        try:
            text = json.dumps({"input_hash": input_hash, "engine_version": __version__, "loss": loss,
                               "graph_hash": out.structural_hash(), "graph": out.to_dict(),
                               "pairs": [list(p) for p in pairs], "reports": [r.to_dict() for r in reports]})
            exact = Graph.from_dict(json.loads(text)["graph"]).to_dict() == out.to_dict()
        except (TypeError, ValueError, MeganeuraError):   # an attribute JSON cannot hold
            exact = False
        if exact:
            write_entry(path, text, "optimized graph")
    return out, pairs, reports
