"""The Studio's model layer: the current model, its graphs, parameters and fusion report.

A small QObject that only emits signals; it holds engine objects and never touches
widgets (napari style). Every failing operation raises ``MeganeuraError`` *before*
changing anything, so a failed load keeps the previous model and weights.
"""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import QObject, Signal

from engine.importers import load_model, source_kind
from engine.errors import MeganeuraError

GRAPH_KINDS = ("original", "optimized", "training")


def optimizer_import():
    """What makes the optimized graph an inference session runs (``engine.optimize``'s
    rules, then its passes: ``optimize_inference``), or the reason it cannot be imported."""
    try:
        from engine.optimize.passes import optimize_inference
    except Exception as exc:  # ImportError, or an error inside the package being written
        return None, f"{type(exc).__name__}: {exc}"
    return optimize_inference, None


class ProfileResult:
    """A ProfileReport with what the Studio needs to map dispatches to graph nodes."""

    def __init__(self, report, session, graph, train: bool):
        from engine.runtime.dispatches import session_dispatches
        self.report, self.graph, self.train = report, graph, train
        self.peak_bytes = int(session.plan.peak_bytes)
        infos = session_dispatches(session)
        plan = session.plan
        # dispatch position in a step -> node ids of session.graph it runs
        self.dispatch_nodes: list[list[int]] = [
            list(plan.dispatches[i.plan_index].nodes) if i.plan_index is not None else [] for i in infos]
        last = report.steps - 1
        # node id -> its dispatches in the last step (two for a node with a finishing
        # stage: a loss, a split attention or matmul)
        self.node_dispatches: dict[int, list[dict]] = {}
        for d in report.dispatches:
            if d.step != last:
                continue
            for nid in self.dispatch_nodes[d.index] if d.index < len(self.dispatch_nodes) else ():
                self.node_dispatches.setdefault(nid, []).append(
                    {"index": d.index, "kernel": d.kernel, "gpu_ns": d.gpu_ns})


class StudioState(QObject):
    modelChanged = Signal()              # model, settings and graphs replaced
    paramsChanged = Signal()             # new weights (loaded, initialised or trained)
    optimizedChanged = Signal()          # an optimized graph and its report are ready
    sessionChanged = Signal()            # a GPU session was built (status bar: its memory)
    profileChanged = Signal()            # a new ProfileResult

    def __init__(self, parent=None):
        super().__init__(parent)
        self.source: str | None = None    # what was opened: a built-in name, an .onnx file or a checkpoint folder
        self.model_name: str | None = None
        self.model = None
        self.settings: dict = {}
        self.params: dict[str, np.ndarray] = {}
        self.weights_path: str | None = None
        self.graphs: dict[str, object] = {}
        self.report = None               # OptimizeReport of graphs["optimized"]
        self.session = None               # the last GPU session built (profile or training)
        self.session_label = ""
        self.profile: ProfileResult | None = None

    # ------------------------------------------------------------ model and weights

    def load_model(self, source: str, settings: dict | None = None, seed: int = 0, progress=None) -> None:
        """Open and build ``source`` (a built-in name, an .onnx file or a checkpoint
        folder); replaces everything only when all of it worked. ``progress``: as a
        checkpoint's weights are read (``engine.importers.load_model``)."""
        overrides = [f"{k}={v}" for k, v in (settings or {}).items()]
        options = {"default_dims": 1} if source_kind(str(source)) == "onnx" else {}   # editable in the panel
        model = load_model(str(source), overrides, progress=progress, **options)
        self.install_model(source, model, model.build(train=False), model.init_params(seed))

    def install_model(self, source: str, model, graph, params: dict[str, np.ndarray]) -> None:
        """Make ``model`` (opened from ``source``, its inference ``graph`` built, ``params``)
        the open one. Split from ``load_model`` so that a resumed run's model, opened and
        built beforehand, goes in only once its checkpoint was read and bound: a run that
        cannot resume leaves the open model and its weights alone."""
        self.source, self.model_name, self.model, self.settings = str(source), model.name, model, dict(model.settings)
        self.graphs = {"original": graph}
        self.report = None
        self.profile = None
        self.session, self.session_label = None, ""
        self.params, self.weights_path = params, None
        self.modelChanged.emit()
        self.paramsChanged.emit()
        self.sessionChanged.emit()
        self.profileChanged.emit()

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
            from engine.autodiff.gradients import differentiate
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
        """Optimized-graph node ids produced by ``rule`` (``OptimizeReport.rule_nodes``)."""
        d = self.report_dict() or {}
        return [int(i) for i in (d.get("rule_nodes") or {}).get(rule, [])]

    # ------------------------------------------------------------ GPU session and profile

    def set_session(self, session, label: str) -> None:
        """The GPU session the Studio last built (a profile's or a training run's)."""
        self.session, self.session_label = session, label
        self.sessionChanged.emit()

    def set_profile(self, profile: "ProfileResult") -> None:
        self.profile = profile
        self.profileChanged.emit()

    def dispatches_of(self, graph, node_id: int) -> list[dict] | None:
        """The last profile's dispatches running node ``node_id`` of ``graph``: {index,
        kernel, gpu_ns (last step)} each, [] for a node that has none; None without a
        profile of that graph."""
        p = self.profile
        if p is None or graph is None or p.graph is not graph:
            return None
        return p.node_dispatches.get(node_id, [])
