"""Executing an ExecutionPlan on the wgpu device.

``Session`` allocates one GPU buffer per plan buffer, builds every pipeline and bind
group once (pipelines are shared between dispatches whose generated WGSL is the same),
and ``run()`` records all dispatches into one compute pass and submits once. Reading
an output (``queue.read_buffer``) is the only wait.
"""

from __future__ import annotations

import time
from typing import Mapping

import numpy as np

from . import codegen
from .compile import ExecutionPlan, cached_plan, compile_plan
from .device import _limit, device_guard, get_device, shader_checks, shader_module
from .errors import DeviceError, MeganeuraError, ShapeError
from .graph import Graph

_NP = {"f32": np.float32, "i32": np.int32}

# (id(device), WGSL source) -> (pipeline, bind group layout), shared by every Session
# on a device: a model's layers and a training and an inference session of one model
# compile each distinct kernel once.
_PIPELINES: dict[tuple[int, str], tuple] = {}


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n} bytes)"


class Session:
    """A graph compiled for the GPU: its buffers, pipelines and bind groups."""

    def __init__(self, graph: Graph, plan: ExecutionPlan | None = None, device=None,
                 parameter_buffers: Mapping[str, object] | None = None,
                 capabilities: codegen.Capabilities | None = None):
        """``parameter_buffers`` (name -> GPU buffer, e.g. another session's
        ``parameter_buffers()``) are used instead of new ones: sessions that share them
        see each other's updates with no copy. ``capabilities`` (default: what the
        device offers, f32 matmuls) picks each kernel's path."""
        import wgpu

        t_start = time.perf_counter_ns()
        self.graph = graph
        self.plan = plan if plan is not None else compile_plan(graph, loss=None)
        self.device = device if device is not None else get_device()
        self._wgpu = wgpu
        dev = self.device
        self.capabilities = capabilities or codegen.Capabilities.from_features(dev.features)
        limits = dev.limits
        max_binding = _limit(limits, "max_storage_buffer_binding_size") or 2**27
        uniform_align = _limit(limits, "min_uniform_buffer_offset_alignment") or 256
        uniform_align = max(uniform_align, 256)

        # Kernels first: an unsupported op fails before anything is allocated.
        self.kernels: list[codegen.Kernel] = []
        for d in self.plan.dispatches:
            (nid,) = d.nodes
            self.kernels.append(codegen.kernel_for(graph, graph[nid], self.capabilities))
        t_kernels = time.perf_counter_ns()

        # One GPU buffer per plan buffer, each checked against the binding limit.
        names_of: dict[int, list[str]] = {}
        for n in graph.nodes:
            b = self.plan.node_buffer.get(n.id)
            if b is not None:
                names_of.setdefault(b, []).append(n.name or n.label)
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        shared = {self.plan.parameters[k]: v for k, v in (parameter_buffers or {}).items()
                  if k in self.plan.parameters}
        self.buffers = []
        for buf in self.plan.buffers:
            if buf.id in shared:
                if shared[buf.id].size < buf.nbytes:
                    raise ShapeError(f"shared parameter buffer for {buf.names} holds {shared[buf.id].size} "
                                     f"bytes, the graph needs {buf.nbytes}")
                self.buffers.append(shared[buf.id])
                continue
            if buf.nbytes > max_binding:
                who = ", ".join(buf.names or names_of.get(buf.id, [f"buffer {buf.id}"])[:3])
                raise DeviceError(
                    f"tensor {who} needs {_fmt_bytes(buf.nbytes)}, over the adapter's "
                    f"max_storage_buffer_binding_size of {_fmt_bytes(max_binding)}; "
                    f"use a smaller batch or sequence length")
            self.buffers.append(dev.create_buffer(label=f"buf{buf.id}", size=buf.nbytes, usage=usage))

        # All dispatches' parameter words in one uniform buffer, one aligned slot each.
        offsets, total = [], 0
        for k in self.kernels:
            offsets.append(total)
            total += -(-k.meta_vec4 * 16 // uniform_align) * uniform_align
        blob = np.zeros(max(total, 16) // 4, dtype=np.uint32)
        for k, off in zip(self.kernels, offsets):
            blob[off // 4: off // 4 + len(k.meta)] = np.asarray(k.meta, dtype=np.uint64).astype(np.uint32)
        self.meta_buffer = dev.create_buffer(
            label="meta", size=blob.nbytes,
            usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        dev.queue.write_buffer(self.meta_buffer, 0, blob)

        # Pipelines (cached by source) and one bind group per dispatch.
        t_buffers = time.perf_counter_ns()
        self._pipelines: dict[str, tuple] = {}
        self._steps = []
        self.step_dispatches: list[int] = []  # plan dispatch index of each entry of _steps
        for d, k, off in zip(self.plan.dispatches, self.kernels, offsets):
            pipeline, layout = self._pipeline(k)
            (nid,) = d.nodes
            node = graph[nid]
            entries = [{"binding": 0, "resource": {"buffer": self.meta_buffer, "offset": off,
                                                   "size": k.meta_vec4 * 16}}]
            for j, src in enumerate(node.inputs):
                b = self.plan.node_buffer[src]
                entries.append({"binding": j + 1, "resource": {"buffer": self.buffers[b], "offset": 0,
                                                               "size": self.plan.buffers[b].nbytes}})
            ob = d.writes[0]
            entries.append({"binding": len(node.inputs) + 1,
                            "resource": {"buffer": self.buffers[ob], "offset": 0,
                                         "size": self.plan.buffers[ob].nbytes}})
            bind_group = dev.create_bind_group(label=k.name, layout=layout, entries=entries)
            if node.size > 0:
                self._steps.append((pipeline, bind_group, k.workgroups))
                self.step_dispatches.append(d.index)

        for i, c in graph.constants.items():
            if i in self.plan.node_buffer:
                self._write(self.plan.node_buffer[i], np.asarray(c, dtype=_NP[graph[i].dtype]))
        # (name, start ns, end ns) on time.perf_counter_ns: the profiler shows them as CPU spans.
        self.build_spans = [("codegen", t_start, t_kernels), ("allocate buffers", t_kernels, t_buffers),
                            ("create pipelines and bind groups", t_buffers, time.perf_counter_ns())]

    # ------------------------------------------------------------ build helpers

    def _pipeline(self, k: codegen.Kernel):
        hit = self._pipelines.get(k.source) or _PIPELINES.get((id(self.device), k.source))
        if hit is not None:
            self._pipelines[k.source] = hit
            return hit
        wgpu = self._wgpu
        dev = self.device
        ro = wgpu.BufferBindingType.read_only_storage
        entries = [{"binding": 0, "visibility": wgpu.ShaderStage.COMPUTE,
                    "buffer": {"type": wgpu.BufferBindingType.uniform}}]
        for j in range(len(k.operand_types)):
            entries.append({"binding": j + 1, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": ro}})
        entries.append({"binding": len(k.operand_types) + 1, "visibility": wgpu.ShaderStage.COMPUTE,
                        "buffer": {"type": wgpu.BufferBindingType.storage}})
        try:
            module = shader_module(dev, k.name, k.source, shader_checks(k.guarded))
            bgl = dev.create_bind_group_layout(label=k.name, entries=entries)
            pl = dev.create_pipeline_layout(label=k.name, bind_group_layouts=[bgl])
            pipeline = dev.create_compute_pipeline(label=k.name, layout=pl,
                                                   compute={"module": module, "entry_point": "main"})
        except Exception as exc:  # a bug in generated WGSL, not a user error: keep the source at hand
            raise RuntimeError(f"kernel {k.name} failed to build: {exc}\n--- WGSL ---\n{k.source}") from exc
        self._pipelines[k.source] = _PIPELINES[(id(self.device), k.source)] = (pipeline, bgl)
        return pipeline, bgl

    def _write(self, buffer_id: int, arr: np.ndarray):
        data = np.ascontiguousarray(arr)
        if data.nbytes:
            with device_guard("uploading a tensor", self.device):
                self.device.queue.write_buffer(self.buffers[buffer_id], 0, data)

    def _node_for(self, kind: str, name: str, table: Mapping[str, int]):
        if name not in table:
            known = ", ".join(sorted(table)) or "none"
            raise MeganeuraError(f"graph {self.graph.name!r} has no {kind} named {name!r} (its {kind}s: {known})")
        return self.graph[table[name]]

    def _upload(self, kind: str, name: str, array, table_graph, table_plan):
        node = self._node_for(kind, name, table_graph)
        arr = np.asarray(array)
        if tuple(arr.shape) != node.shape:
            raise ShapeError(f"{kind} {name!r}: expected shape {list(node.shape)}, found {list(arr.shape)}")
        if node.dtype == "i32":
            if not np.issubdtype(arr.dtype, np.integer):
                raise ShapeError(f"{kind} {name!r}: expected integers (i32), found {arr.dtype}")
        self._write(table_plan[name], arr.astype(_NP[node.dtype]))

    # ------------------------------------------------------------ public API

    @property
    def pipeline_count(self) -> int:
        return len(self._pipelines)

    def set_input(self, name: str, array) -> None:
        self._upload("input", name, array, self.graph.inputs, self.plan.inputs)

    def set_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        for k, v in inputs.items():
            self.set_input(k, v)

    def set_parameter(self, name: str, array) -> None:
        self._upload("parameter", name, array, self.graph.parameters, self.plan.parameters)

    def set_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        for k, v in params.items():
            self.set_parameter(k, v)

    def _read(self, buffer_id: int, node) -> np.ndarray:
        nbytes = 4 * node.size
        if nbytes == 0:
            return np.zeros(node.shape, dtype=_NP[node.dtype])
        with device_guard("reading a tensor back", self.device):
            raw = self.device.queue.read_buffer(self.buffers[buffer_id], 0, nbytes)
        return np.frombuffer(raw, dtype=_NP[node.dtype], count=node.size).reshape(node.shape).copy()

    def parameter_buffers(self) -> dict[str, object]:
        """The GPU buffer of each parameter, to share with another session."""
        return {k: self.buffers[b] for k, b in self.plan.parameters.items()}

    def get_parameter(self, name: str) -> np.ndarray:
        node = self._node_for("parameter", name, self.graph.parameters)
        return self._read(self.plan.parameters[name], node)

    def record(self, encoder, timestamps=None, dispatches=None) -> None:
        """Record the dispatches of one step into ``encoder``: all of them (or the
        positions in ``_steps`` listed in ``dispatches``) in one compute pass.

        ``timestamps`` (an ``engine.profiler.DispatchTimestamps``) adds GPU timestamps
        around each dispatch: written inside the pass where the device allows it, else
        one compute pass per dispatch with the pass's timestamp writes."""
        order = range(len(self._steps)) if dispatches is None else dispatches
        self._record_steps(encoder, "step", self._steps, order, timestamps)

    @staticmethod
    def _record_steps(encoder, label, steps, positions, timestamps=None) -> None:
        """Dispatch ``steps[i]`` for each ``i`` in ``positions`` (``i`` also numbers the
        dispatch's timestamps) in one compute pass, or one pass each when timestamps
        cannot be written inside a pass."""
        if timestamps is not None and not timestamps.inside_passes:
            for i in positions:
                pipeline, bind_group, (x, y, z) = steps[i]
                cp = encoder.begin_compute_pass(label=f"{label} {i}", timestamp_writes=timestamps.pass_writes(i))
                cp.set_pipeline(pipeline)
                cp.set_bind_group(0, bind_group)
                cp.dispatch_workgroups(x, y, z)
                cp.end()
            return
        cp = encoder.begin_compute_pass(label=label)
        for i in positions:
            pipeline, bind_group, (x, y, z) = steps[i]
            if timestamps is not None:
                timestamps.write(cp, i, 0)
            cp.set_pipeline(pipeline)
            cp.set_bind_group(0, bind_group)
            cp.dispatch_workgroups(x, y, z)
            if timestamps is not None:
                timestamps.write(cp, i, 1)
        cp.end()

    def run(self) -> None:
        """Record every dispatch into one compute pass and submit once (no wait)."""
        with device_guard("running a step", self.device):
            enc = self.device.create_command_encoder(label="step")
            self.record(enc)
            self.device.queue.submit([enc.finish()])

    def profile(self, steps: int = 10, train: bool = False, **options):
        """Run ``steps`` steps with GPU timestamps around every dispatch; returns an
        ``engine.profiler.ProfileReport`` (see ``engine.profiler.profile_session``)."""
        from .profiler import profile_session
        return profile_session(self, steps, train=train, **options)

    def read_output(self, name: str) -> np.ndarray:
        node = self._node_for("output", name, self.graph.outputs)
        return self._read(self.plan.outputs[name], node)

    def read_outputs(self) -> dict[str, np.ndarray]:
        return {k: self.read_output(k) for k in self.graph.outputs}

    def read_loss(self) -> float:
        """The scalar ``loss`` output (waits for the submitted work)."""
        buf = self.plan.loss_buffer
        if buf is None:
            if "loss" not in self.graph.outputs:
                raise MeganeuraError(f"graph {self.graph.name!r} has no 'loss' output")
            buf = self.plan.outputs["loss"]
        with device_guard("reading the loss", self.device):
            raw = self.device.queue.read_buffer(self.buffers[buf], 0, 4)
        return float(np.frombuffer(raw, dtype=np.float32, count=1)[0])


def build_inference_session(graph: Graph, plan: ExecutionPlan | None = None, share_with: Session | None = None,
                            optimize: bool = True, capabilities: codegen.Capabilities | None = None) -> Session:
    """A Session running ``graph`` forward on the default device, fused by
    ``engine.optimize`` unless ``optimize=False`` (or a plan is given). With
    ``share_with`` (e.g. a training session of the same model at another batch size) it
    uses that session's parameter buffers: every update the other session makes is
    seen here, with no copy."""
    if optimize and plan is None:
        from .optimize import optimize as fuse
        graph, _ = fuse(graph)
    shared = share_with.parameter_buffers() if share_with is not None else None
    device = share_with.device if share_with is not None else None
    return Session(graph, plan if plan is not None else cached_plan(graph, loss="loss"), device, shared,
                   capabilities)
