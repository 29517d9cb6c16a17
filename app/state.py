"""The Studio's model layer: the current model, its graphs, parameters and fusion report.

A small QObject that only emits signals; it holds engine objects and never touches
widgets (napari style). Every failing operation raises ``MeganeuraError`` *before*
changing anything, so a failed load keeps the previous model and weights.
"""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import QObject, Signal

from engine import models
from engine.errors import MeganeuraError

GRAPH_KINDS = ("original", "optimized", "training")


def optimizer_import():
    """``engine.optimize.optimize`` or the reason it cannot be imported."""
    try:
        from engine.optimize import optimize  # noqa: F401
    except Exception as exc:  # ImportError, or an error inside the package being written
        return None, f"{type(exc).__name__}: {exc}"
    return optimize, None


class StudioState(QObject):
    modelChanged = Signal()              # model, settings and graphs replaced
    paramsChanged = Signal()             # new weights (loaded, initialised or trained)
    optimizedChanged = Signal()          # an optimized graph and its report are ready

    def __init__(self, parent=None):
        super().__init__(parent)
        self.model_name: str | None = None
        self.model = None
        self.settings: dict = {}
        self.params: dict[str, np.ndarray] = {}
        self.weights_path: str | None = None
        self.graphs: dict[str, object] = {}
        self.report = None               # OptimizeReport of graphs["optimized"]

    # ------------------------------------------------------------ model and weights

    def load_model(self, name: str, settings: dict | None = None, seed: int = 0) -> None:
        """Configure and build ``name``; replaces everything only when all of it worked."""
        model = models.get(name)(**(settings or {}))
        graph = model.build(train=False)
        params = model.init_params(seed)
        self.model_name, self.model, self.settings = name, model, dict(model.settings)
        self.graphs = {"original": graph}
        self.report = None
        self.params, self.weights_path = params, None
        self.modelChanged.emit()
        self.paramsChanged.emit()

    def load_weights(self, path: str) -> None:
        if self.model is None:
            raise MeganeuraError("load a model before opening weights")
        params = self.model.load_weights(path)   # WeightsError lists every offending tensor
        self.params, self.weights_path = params, str(path)
        self.paramsChanged.emit()

    def set_params(self, params: dict[str, np.ndarray], source: str | None = None) -> None:
        self.params = dict(params)
        self.weights_path = source
        self.paramsChanged.emit()

    def save_weights(self, path: str) -> None:
        if self.model is None:
            raise MeganeuraError("no model to save")
        self.model.save_weights(self.params, path)

    # ------------------------------------------------------------ graphs

    def graph(self, kind: str):
        """The original, optimized or training graph; None while the optimized one is missing."""
        if kind not in GRAPH_KINDS:
            raise MeganeuraError(f"unknown graph kind {kind!r}")
        if kind == "training" and "training" not in self.graphs and self.model is not None:
            from engine.autodiff import differentiate
            self.graphs["training"] = differentiate(self.model.build(train=True))[0]
        return self.graphs.get(kind)

    def set_optimized(self, graph, report) -> None:
        self.graphs["optimized"] = graph
        self.report = report
        self.optimizedChanged.emit()

    def report_dict(self) -> dict | None:
        if self.report is None:
            return None
        return self.report.to_dict() if hasattr(self.report, "to_dict") else dict(self.report)

    def origins(self) -> dict[int, list[int]]:
        d = self.report_dict() or {}
        return {int(k): list(v) for k, v in (d.get("origins") or {}).items()}

    def rule_nodes(self, rule: str) -> list[int]:
        """Optimized-graph node ids produced by ``rule``.

        The report contract has no rule -> node map yet, so: a ``rule_nodes`` entry of
        the report if present; else nodes whose attrs name the rule; else the fused
        nodes (more than one origin) whose op appears in the rule name (or vice versa);
        else every fused node."""
        d = self.report_dict() or {}
        if d.get("rule_nodes") and rule in d["rule_nodes"]:
            return [int(i) for i in d["rule_nodes"][rule]]
        graph = self.graphs.get("optimized")
        if graph is None:
            return []
        named = [n.id for n in graph.nodes
                 if n.attrs.get("rule") == rule or rule in (n.attrs.get("rules") or ())]
        if named:
            return named
        origins = self.origins()
        fused = [i for i, o in origins.items() if len(o) > 1 and i < len(graph.nodes)]
        key = rule.lower()
        by_op = [i for i in fused if graph[i].op in key or key in graph[i].op]
        return by_op or fused
