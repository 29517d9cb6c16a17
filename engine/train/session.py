"""Training on the GPU: forward, backward and the optimizer update in one step's commands.

``TrainingSession`` is a ``Session`` of the training graph (``differentiate`` of the
model's graph) compiled with its optimizer: the plan holds the whole step, from the
forward pass to one update dispatch per parameter group (see ``engine.compile``). A
step uploads the step's learning rate and bias corrections and submits the command
buffers holding everything (``Session.record_parts``, recorded while the previous step
ran); reading the loss and the gradient norm (one buffer) is its only wait.
"""

from __future__ import annotations

import math
import time

import numpy as np

from .. import codegen
from ..autodiff.gradients import differentiate
from ..compile.plan import STATE_NAMES, OptimizerSpec
from ..compile.cache import cached_plan, cached_training_graph
from ..runtime.device import device_guard, get_device
from ..errors import TrainingError
from ..graph.ir import Graph
from ..runtime.session import Session
from ..runtime.device import device_capabilities
from .config import TrainConfig, freeze_by_multiplier, learning_rate


class TrainingSession(Session):
    """The pipeline of DESIGN.md: optimize the forward graph, differentiate it (so the
    backward of fused ops is fused too), optimize the training graph again, compile it
    with the optimizer, and build the GPU session. ``optimize=False`` skips both fusion
    passes. The graphs and the plan come from the on-disk cache when a process built
    them before (``engine.compile.cache``)."""

    is_training = True

    def __init__(self, graph: Graph, config: TrainConfig | None = None, device=None, optimize: bool = True,
                 capabilities: codegen.Capabilities | None = None):
        self.config = config or TrainConfig()
        device = device if device is not None else get_device()
        start = time.perf_counter_ns()
        forward = freeze_by_multiplier(graph, self.config)
        if optimize:
            train_graph, self.pairs, self.forward_report, self.training_report = cached_training_graph(
                forward, self.config.loss)
        else:
            train_graph, self.pairs = differentiate(forward, self.config.loss)
        optimized = time.perf_counter_ns()
        spec = OptimizerSpec.from_config(self.config, graph, [name for name, _ in self.pairs])
        plan = cached_plan(train_graph, gradients=dict(self.pairs), loss=self.config.loss,
                           capabilities=capabilities or device_capabilities(device), optimizer=spec)
        compiled = time.perf_counter_ns()
        super().__init__(train_graph, plan, device)
        self.build_spans = [("optimize, differentiate, optimize", start, optimized),
                            ("compile plan", optimized, compiled), *self.build_spans]
        self.model_graph = graph
        self.step_count = 0

    def prepare_step(self) -> None:
        """Upload this step's learning rate and bias corrections."""
        t = self.step_count + 1
        b1, b2 = self.config.betas
        lr = learning_rate(self.config, self.step_count)
        values = np.array([lr, 1.0 - b1 ** t, math.sqrt(1.0 - b2 ** t), 1.0 if t == 1 else 0.0], np.float32)
        self.device.queue.write_buffer(self.buffers[self.plan.step_buffer], 0, values)

    def finish_step(self) -> tuple[float, float]:
        """Wait for the step's results: (loss, gradient norm before clipping)."""
        raw = self.device.queue.read_buffer(self.buffers[self.plan.stats_buffer], 0, 8)
        stats = np.frombuffer(raw, dtype=np.float32)
        loss, norm = float(stats[0]), float(stats[1])
        if math.isfinite(loss) and math.isfinite(norm):
            self.step_count += 1
        return loss, norm

    def step(self) -> tuple[float, float]:
        """One training step on the inputs already set: returns (loss, gradient norm
        before clipping). A non-finite loss or norm leaves the parameters and the
        optimizer state untouched.

        Every step records the same commands (inputs, learning rate and the rest are
        data, uploaded before the submit), so the next step's command buffers are recorded
        while the GPU runs this one: recording ~250 dispatches costs the host a few ms
        that would otherwise come before every step's GPU work."""
        with device_guard(f"running training step {self.step_count + 1}", self.device):
            self.prepare_step()
            parts = self._recorded or self.record_parts()
            self._recorded = None
            self.submit(parts)
            self._recorded = self.record_parts()
            return self.finish_step()

    _recorded = None  # the next step's command buffers, recorded ahead

    def get_parameters(self) -> dict[str, np.ndarray]:
        return {name: self.get_parameter(name) for name in self.graph.parameters}

    def _state_slots(self):
        """(arena buffer index, state name, parameter, byte offset, shape) of every optimizer state."""
        names = STATE_NAMES[self.config.optimizer]
        for group in self.plan.groups:
            for buffer, state in zip(group.state_buffers, names):
                for name, offset in zip(group.parameters, group.offsets):
                    yield buffer, state, name, offset, self.graph[self.graph.parameters[name]].shape

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The optimizer's state on the GPU as ``{"PARAM:m": array, ...}`` (Adam's m and v,
        SGD's momentum), each in its parameter's shape; one read per arena."""
        arenas, out = {}, {}
        with device_guard("reading the optimizer state", self.device):
            for buffer, state, name, offset, shape in self._state_slots():
                if buffer not in arenas:
                    raw = self.device.queue.read_buffer(self.buffers[buffer], self._bases[buffer],
                                                        self.plan.buffers[buffer].nbytes)
                    arenas[buffer] = np.frombuffer(raw, dtype=np.float32)
                count = int(np.prod(shape))
                out[f"{name}:{state}"] = arenas[buffer][offset // 4: offset // 4 + count].reshape(shape).copy()
        return out

    def set_optimizer_state(self, tensors: dict[str, np.ndarray], steps: int) -> None:
        """Upload an optimizer state (as ``optimizer_state`` gives it) taken after ``steps``
        updates; the next step is update ``steps + 1`` (bias corrections, schedule)."""
        slots = list(self._state_slots())
        missing = [f"{name}:{state}" for _, state, name, _, _ in slots if f"{name}:{state}" not in tensors]
        if missing:
            raise TrainingError(f"the optimizer state has no {', '.join(missing[:3])}"
                                f"{' ...' if len(missing) > 3 else ''} ({self.config.optimizer})")
        with device_guard("uploading the optimizer state", self.device):
            for buffer, state, name, offset, shape in slots:
                value = np.ascontiguousarray(tensors[f"{name}:{state}"], dtype=np.float32)
                if value.shape != tuple(shape):
                    raise TrainingError(f"optimizer state {name}:{state} has shape {list(value.shape)}, "
                                        f"expected {list(shape)}")
                if value.nbytes:
                    self.device.queue.write_buffer(self.buffers[buffer], self._bases[buffer] + offset, value)
        self.step_count = steps


def build_session(graph: Graph, config: TrainConfig | None = None, params=None,
                  optimize: bool = True, capabilities: codegen.Capabilities | None = None) -> TrainingSession:
    """A GPU training session of ``graph`` (which has a scalar ``loss`` output)."""
    session = TrainingSession(graph, config, optimize=optimize, capabilities=capabilities)
    if params is not None:
        session.set_parameters(params)
    return session
