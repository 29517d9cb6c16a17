"""Training on the GPU: forward, backward and the optimizer update in one submission.

``TrainingSession`` is a ``Session`` of the training graph (``differentiate`` of the
model's graph, compiled with its gradient outputs) plus, per trainable parameter,
optimizer state buffers and two extra kernels: the sum of squares of its gradient
(for clipping by global norm) and the in-place update. A step uploads the step's
learning rate and bias corrections, records everything into one command buffer and
submits once; reading the loss (and the gradient-norm partial sums, in the same
buffer) is its only wait.
"""

from __future__ import annotations

import math

import numpy as np

from . import codegen
from .autodiff import differentiate
from .compile import cached_plan
from .graph import Graph
from .device import device_guard, shader_module
from .runtime import _PIPELINES, Session
from .train import TrainConfig, freeze_by_multiplier, learning_rate


class TrainingSession(Session):
    """The pipeline of DESIGN.md: optimize the forward graph, differentiate it (so the
    backward of fused ops is fused too), optimize the training graph again, compile,
    and build the GPU session. ``optimize=False`` skips both fusion passes."""

    def __init__(self, graph: Graph, config: TrainConfig | None = None, device=None, optimize: bool = True,
                 capabilities: codegen.Capabilities | None = None):
        from .optimize import optimize as fuse
        self.config = config or TrainConfig()
        forward = freeze_by_multiplier(graph, self.config)
        if optimize:
            forward, self.forward_report = fuse(forward)
        train_graph, self.pairs = differentiate(forward, self.config.loss)
        if optimize:
            train_graph, self.training_report = fuse(train_graph)
        plan = cached_plan(train_graph, gradients=dict(self.pairs), loss=self.config.loss)
        super().__init__(train_graph, plan, device, capabilities=capabilities)
        self.model_graph = graph
        self.step_count = 0
        self._build_optimizer()

    # ------------------------------------------------------------ build

    def _storage(self, label: str, nbytes: int, extra_usage=0):
        wgpu = self._wgpu
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC | extra_usage
        return self.device.create_buffer(label=label, size=max(16, nbytes), usage=usage)

    def _layout_pipeline(self, k: codegen.Kernel, reads: int, writes: int):
        """Pipeline for a training-step kernel: meta, ``reads`` read-only then ``writes``
        read-write storage bindings (cached by source like the graph kernels)."""
        key = (id(self.device), k.source)
        if key in _PIPELINES:
            return _PIPELINES[key]
        wgpu = self._wgpu
        kinds = ([wgpu.BufferBindingType.uniform] + [wgpu.BufferBindingType.read_only_storage] * reads
                 + [wgpu.BufferBindingType.storage] * writes)
        entries = [{"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": t}}
                   for i, t in enumerate(kinds)]
        bgl = self.device.create_bind_group_layout(label=k.name, entries=entries)
        layout = self.device.create_pipeline_layout(label=k.name, bind_group_layouts=[bgl])
        module = shader_module(self.device, k.name, k.source)
        pipeline = self.device.create_compute_pipeline(label=k.name, layout=layout,
                                                       compute={"module": module, "entry_point": "main"})
        _PIPELINES[key] = (pipeline, bgl)
        return pipeline, bgl

    def _dispatch(self, k: codegen.Kernel, buffers: list, reads: int):
        wgpu = self._wgpu
        meta = np.zeros(k.meta_vec4 * 4, dtype=np.uint32)
        meta[: len(k.meta)] = np.asarray(k.meta, dtype=np.uint64).astype(np.uint32)
        ubuf = self.device.create_buffer_with_data(data=meta, usage=wgpu.BufferUsage.UNIFORM)
        pipeline, bgl = self._layout_pipeline(k, reads, len(buffers) - reads)
        entries = [{"binding": 0, "resource": {"buffer": ubuf, "offset": 0, "size": meta.nbytes}}]
        entries += [{"binding": i + 1, "resource": {"buffer": b, "offset": 0, "size": b.size}}
                    for i, b in enumerate(buffers)]
        return pipeline, self.device.create_bind_group(label=k.name, layout=bgl, entries=entries), k.workgroups

    def _build_optimizer(self):
        c = self.config
        sizes = [self.graph[self.graph.parameters[name]].size for name, _ in self.pairs]
        self.norm_partial_count = partials = sum(codegen.norm_partials(n) for n in sizes)
        self.stats = self._storage("stats", 4 * (2 + partials))  # loss, squared norm, partials
        self.step_values = self._storage("step", 16)
        self._norm_steps, self._update_steps = [], []
        self.optimizer_state: dict[str, list] = {}
        kind = c.optimizer
        slot = 2
        for name, grad_output in self.pairs:
            node = self.graph[self.graph.parameters[name]]
            grad = self.buffers[self.plan.outputs[grad_output]]
            param = self.buffers[self.plan.parameters[name]]
            self._norm_steps.append(self._dispatch(codegen.sum_squares_kernel(node.size, slot),
                                                   [grad, self.stats], reads=1))
            slot += codegen.norm_partials(node.size)
            needs = 2 if kind != "sgd" else (1 if c.momentum else 0)
            state = [self._storage(f"{name}.state{i}", node.nbytes) for i in range(needs)]
            self.optimizer_state[name] = state
            padded = state + [self._storage("unused", 16) for _ in range(2 - len(state))]
            decays = self.model_graph.param_meta.get(name, {}).get("decay", False)
            kernel = codegen.optimizer_kernel(node.size, kind, c.multiplier(name),
                                              c.weight_decay if decays else 0.0, c.momentum, c.betas,
                                              c.eps, c.clip_norm)
            self._update_steps.append(self._dispatch(kernel, [grad, self.stats, self.step_values, param, *padded],
                                                     reads=3))
        self._norm_steps.append(self._dispatch(codegen.norm_total_kernel(partials), [self.stats], reads=0))
        self._loss_buffer = self.buffers[self.plan.loss_buffer]

    # ------------------------------------------------------------ step

    is_training = True

    def _all_steps(self) -> list:
        """Every dispatch of a step in order: the graph's, the gradient norms, the updates."""
        return self._steps + self._norm_steps + self._update_steps

    def prepare_step(self) -> None:
        """Upload this step's learning rate and bias corrections."""
        t = self.step_count + 1
        b1, b2 = self.config.betas
        lr = learning_rate(self.config, self.step_count)
        values = np.array([lr, 1.0 - b1 ** t, math.sqrt(1.0 - b2 ** t), 1.0 if t == 1 else 0.0], np.float32)
        self.device.queue.write_buffer(self.step_values, 0, values)

    def record(self, encoder, timestamps=None, dispatches=None) -> None:
        """Forward, backward and gradient norms in one pass, the loss copied next to the
        norms, the updates in a second pass (``dispatches``: positions in
        ``_all_steps()``; ``timestamps`` as in ``Session.record``)."""
        steps = self._all_steps()
        order = range(len(steps)) if dispatches is None else list(dispatches)
        first_update = len(self._steps) + len(self._norm_steps)
        self._record_steps(encoder, "forward+backward", steps, [i for i in order if i < first_update], timestamps)
        if first_update - 1 in order:
            encoder.copy_buffer_to_buffer(self._loss_buffer, 0, self.stats, 0, 4)
        self._record_steps(encoder, "update", steps, [i for i in order if i >= first_update], timestamps)

    def finish_step(self) -> tuple[float, float]:
        """Wait for the step's results: (loss, gradient norm before clipping)."""
        stats = np.frombuffer(self.device.queue.read_buffer(self.stats, 0, 8), dtype=np.float32)
        loss, norm = float(stats[0]), math.sqrt(float(stats[1]))
        if math.isfinite(loss) and math.isfinite(norm):
            self.step_count += 1
        return loss, norm

    def step(self) -> tuple[float, float]:
        """One training step on the inputs already set: returns (loss, gradient norm
        before clipping). A non-finite loss or norm leaves the parameters untouched."""
        with device_guard(f"running training step {self.step_count}", self.device):
            self.prepare_step()
            enc = self.device.create_command_encoder(label=f"train step {self.step_count}")
            self.record(enc)
            self.device.queue.submit([enc.finish()])
            return self.finish_step()

    def get_parameters(self) -> dict[str, np.ndarray]:
        return {name: self.get_parameter(name) for name in self.graph.parameters}


def build_session(graph: Graph, config: TrainConfig | None = None, params=None,
                  optimize: bool = True, capabilities: codegen.Capabilities | None = None) -> TrainingSession:
    """A GPU training session of ``graph`` (which has a scalar ``loss`` output)."""
    session = TrainingSession(graph, config, optimize=optimize, capabilities=capabilities)
    if params is not None:
        session.set_parameters(params)
    return session
