"""Executing an ExecutionPlan on the wgpu device.

The plan holds everything a step needs (kernel sources, parameter words, bindings,
workgroup counts, copies between passes): ``Session`` allocates one GPU buffer per plan
buffer (or uses a shared one, for parameters another session owns), writes every
dispatch's parameter words into one uniform buffer, builds each distinct pipeline and
every bind group once, and ``run()`` records all dispatches into compute passes (a new
one after each of the plan's copies) and submits them, on Dawn in chunks
(``submission_chunks``). Reading an output (``queue.read_buffer``) is the only wait.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from typing import Mapping

import numpy as np

from .. import codegen
from ..compile.plan import ALIGN, ExecutionPlan, KernelSource, Transfer, compile_plan
from ..compile.cache import cached_optimize, cached_plan
from .device import (_limit, backend, device_capabilities, device_guard, get_device, native_api,
                     offered_capabilities, shader_checks, shader_module, wgpu_module)
from ..arrays import bf16_bits, contiguous
from ..errors import DeviceError, MeganeuraError, ShapeError
from ..graph.ir import Graph
from ..graph.reference import check_array

_NP = {"f32": np.float32, "i32": np.int32}

# (id(device), kernel key) -> (pipeline, bind group layout), shared by every Session
# on a device: a model's layers and a training and an inference session of one model
# compile each distinct kernel once.
_PIPELINES: dict[tuple[int, str], tuple] = {}
PIPELINE_THREADS = 16   # most threads building pipelines at once (``Session._build_pipelines``)


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n} bytes)"


def _as_view(view) -> tuple[object, int, int]:
    """(GPU buffer, byte offset, byte size) of a shared parameter: a view, or a whole buffer."""
    return tuple(view) if isinstance(view, tuple) else (view, 0, int(view.size))


# A step goes to the GPU in submissions that double from 16 dispatches up to 128, so that
# the GPU starts on the first while the host prepares the rest. The host works on a command
# buffer when its commands are encoded (generation encodes a step as it submits it: a
# 30-layer model's few hundred dispatches take milliseconds, as long as running them) and,
# on Dawn, again when it is submitted: Dawn translates it into Vulkan commands then, about
# 7 us a dispatch on the H100's host. A training step, encoded while the step before ran,
# waited for the whole of that translation. In these chunks, Dawn f16 on the H100
# (docs/benchmarks.md, run 36): gpt-tiny's step 5.49-5.56 -> 4.98-5.01 ms, audio-align's
# 5.93-6.43 -> 5.38-5.41, whisper-tiny's at batch 1 5.25-5.30 -> 4.97-5.01, at batch 8
# 17.54-17.76 -> 17.28-17.31, the SmolLM2-shaped Llama's (1,648 dispatches) 33.5-36.0 ->
# 30.1-30.4; three parts cut after 5% and 20% of the dispatches did as well (within 0.1 ms).
def submission_chunks(count: int, first: int = 16, largest: int = 128) -> list[range]:
    """Dispatch positions 0..count-1 in submissions that double from ``first`` up to ``largest``."""
    chunks, start, size = [], 0, first
    while start < count:
        chunks.append(range(start, min(count, start + size)))
        start, size = start + size, min(2 * size, largest)
    return chunks


class Session:
    """A graph's ExecutionPlan on the GPU: its buffers, pipelines and bind groups."""

    def __init__(self, graph: Graph, plan: ExecutionPlan | None = None, device=None,
                 parameter_buffers: Mapping[str, object] | None = None,
                 capabilities: codegen.Capabilities | None = None):
        """``parameter_buffers`` (name -> (GPU buffer, byte offset, byte size) or a whole
        GPU buffer, e.g. another session's ``parameter_buffers()``) are used instead of
        new ones: sessions that share them see each other's updates with no copy.
        Without a plan, ``graph`` is compiled for ``capabilities`` (default: what the
        device offers)."""
        wgpu = wgpu_module()

        t_start = time.perf_counter_ns()
        self.graph = graph
        self.device = device if device is not None else get_device()
        self._wgpu = wgpu
        compiled = plan is None
        if compiled:
            plan = compile_plan(graph, loss=None, capabilities=capabilities or device_capabilities(self.device),
                                pack_parameters=not parameter_buffers)
        self.plan = plan
        fields = {k: v for k, v in plan.capabilities.items() if k != "paths"}
        self.capabilities = codegen.Capabilities(**fields) if fields else codegen.PLAIN
        self._check_device()
        t_checked = time.perf_counter_ns()
        self._allocate(parameter_buffers or {})
        t_buffers = time.perf_counter_ns()
        self._build_dispatches()
        for i, c in graph.constants.items():
            if i in self.plan.node_buffer:
                self._write(i, np.asarray(c, dtype=_NP[graph[i].dtype]))
        # (name, start ns, end ns) on time.perf_counter_ns: the profiler shows them as CPU spans.
        self.build_spans = [("compile plan" if compiled else "check plan against device", t_start, t_checked),
                            ("allocate buffers", t_checked, t_buffers),
                            ("create pipelines and bind groups", t_buffers, time.perf_counter_ns())]

    # ------------------------------------------------------------ build helpers

    def _check_device(self) -> None:
        """The plan's offsets suit the device's storage-buffer alignment, and its kernels
        use only features the device has (whatever precision the process asked for: a
        plan compiled for f16, as ``meganeura tune`` compiles some, runs where the
        device offers cooperative matrices)."""
        align = _limit(self.device.limits, "min_storage_buffer_offset_alignment") or ALIGN
        if ALIGN % align:
            raise DeviceError(f"this adapter needs storage-buffer offsets aligned to {align} bytes; "
                              f"plans align them to {ALIGN}")
        offered = offered_capabilities(self.device)
        missing = []
        for f in dataclasses.fields(offered):
            wanted, has = getattr(self.capabilities, f.name), getattr(offered, f.name)
            if type(has) is int and wanted > has:   # workgroup memory, threads a workgroup
                missing.append(f"{f.name} {wanted} (it has {has})")
            elif type(has) is not int and wanted and not has:
                missing.append(f.name)
        if missing:
            raise DeviceError(f"the plan was compiled for {', '.join(missing)}, which this device lacks; "
                              f"compile it with engine.runtime.device_capabilities(device)")

    def _shared_views(self, parameter_buffers: Mapping[str, object]) -> dict[int, tuple[object, int]]:
        """Plan buffer -> (GPU buffer, base offset) for the plan buffers holding shared parameters."""
        views: dict[int, tuple[object, int]] = {}
        for name, view in parameter_buffers.items():
            if name not in self.plan.parameters:
                continue
            gpu, offset, size = _as_view(view)
            nid = self.graph.parameters[name]
            b, plan_offset = self.plan.place(nid)
            base, need = offset - plan_offset, self.graph[nid].nbytes
            if size < need or base < 0 or base + self.plan.buffers[b].nbytes > gpu.size or base % ALIGN:
                raise ShapeError(f"shared parameter buffer for {name!r} gives {size} bytes at offset {offset} of "
                                 f"a {gpu.size}-byte buffer; the graph needs {need} bytes there, at an offset "
                                 f"that is a multiple of {ALIGN}")
            if views.setdefault(b, (gpu, base)) != (gpu, base):
                raise ShapeError(f"shared parameter {name!r} is not laid out like the other parameters "
                                 f"of plan buffer {b} ({', '.join(self.plan.buffers[b].names)})")
        constant_buffers = {self.plan.node_buffer[i] for i in self.graph.constants if i in self.plan.node_buffer}
        packed = sorted(constant_buffers & set(views))
        if packed:
            raise ShapeError(f"plan buffer {packed[0]} ({', '.join(self.plan.buffers[packed[0]].names)}) packs shared "
                             f"parameters with constants; compile the plan with pack_parameters=False")
        return views

    def _allocate(self, parameter_buffers: Mapping[str, object]) -> None:
        """One GPU buffer per plan buffer (or a shared view), each checked against the binding limit."""
        wgpu = self._wgpu
        max_binding = _limit(self.device.limits, "max_storage_buffer_binding_size") or 2**27
        names_of: dict[int, list[str]] = {}
        for n in self.graph.nodes:
            b = self.plan.node_buffer.get(n.id)
            if b is not None:
                names_of.setdefault(b, []).append(n.name or n.label)
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        shared = self._shared_views(parameter_buffers)
        self.buffers, self._bases = [], []
        for buf in self.plan.buffers:
            if buf.id in shared:
                gpu, base = shared[buf.id]
                self.buffers.append(gpu)
                self._bases.append(base)
                continue
            if buf.nbytes > max_binding:
                who = ", ".join(buf.names or names_of.get(buf.id, [f"buffer {buf.id}"])[:3])
                raise DeviceError(
                    f"tensor {who} needs {_fmt_bytes(buf.nbytes)}, over the adapter's "
                    f"max_storage_buffer_binding_size of {_fmt_bytes(max_binding)}; "
                    f"use a smaller batch or sequence length")
            self.buffers.append(self.device.create_buffer(label=f"buf{buf.id}", size=buf.nbytes, usage=usage))
            self._bases.append(0)

    def _meta_blob(self) -> tuple[np.ndarray, list[int]]:
        """Every dispatch's parameter words in one uniform blob, one aligned slot each."""
        align = max(_limit(self.device.limits, "min_uniform_buffer_offset_alignment") or 256, 256)
        offsets, total = [], 0
        for d in self.plan.dispatches:
            offsets.append(total)
            total += -(-self.plan.kernels[d.key].meta_bytes // align) * align
        blob = np.zeros(max(total, 16) // 4, dtype=np.uint32)
        for d, off in zip(self.plan.dispatches, offsets):
            blob[off // 4: off // 4 + len(d.meta)] = np.asarray(d.meta, dtype=np.uint64).astype(np.uint32)
        return blob, offsets

    def _build_dispatches(self) -> None:
        """Pipelines (one per kernel key) and a bind group per dispatch, from the plan's
        bindings; a graph node with no elements needs no dispatch."""
        blob, offsets = self._meta_blob()
        self.meta_buffer = self.device.create_buffer(
            label="meta", size=blob.nbytes, usage=self._wgpu.BufferUsage.UNIFORM | self._wgpu.BufferUsage.COPY_DST)
        self.device.queue.write_buffer(self.meta_buffer, 0, blob)
        self._pipelines: dict[str, tuple] = {}
        self._build_pipelines()
        self._steps = []
        self.step_dispatches: list[int] = []  # plan dispatch index of each entry of _steps
        for d, off in zip(self.plan.dispatches, offsets):
            if d.nodes and d.elements == 0:
                continue
            kernel = self.plan.kernels[d.key]
            pipeline, layout = self._pipeline(d.key, kernel)
            entries = [{"binding": 0, "resource": {"buffer": self.meta_buffer, "offset": off,
                                                   "size": kernel.meta_bytes}}]
            for j, b in enumerate(d.bindings):
                entries.append({"binding": j + 1, "resource": {"buffer": self.buffers[b.buffer],
                                                               "offset": self._bases[b.buffer] + b.offset,
                                                               "size": b.size}})
            bind_group = self.device.create_bind_group(label=d.kernel, layout=layout, entries=entries)
            self._steps.append((pipeline, bind_group, tuple(d.workgroups)))
            self.step_dispatches.append(d.index)
        position = {index: pos for pos, index in enumerate(self.step_dispatches)}
        self._transfers_after: dict[int, list[Transfer]] = {}
        for t in self.plan.transfers:
            self._transfers_after.setdefault(position[t.after], []).append(t)

    def _build_pipelines(self) -> None:
        """Every kernel of the plan not built on this device yet, built on several threads:
        the driver's shader compiler is most of a session's build time (tens of kernels,
        each tens of ms on NVIDIA), and wgpu-native compiles pipelines concurrently
        (wgpu-py releases the GIL in its calls and keeps its error capture per thread).
        The longest sources (the unrolled attention and matmul kernels, the slowest to
        compile) start first, so that they do not come last to a pool with idle threads.
        Up to 16 threads: the audio-align smoke's 56 kernels on Dawn f16 with an empty driver
        cache took 1.7-1.9 s on 8 threads, 1.4-1.5 s on 12 or 16 (16 cores; 11.8 s on one)."""
        missing = sorted(((key, k) for key, k in self.plan.kernels.items()
                          if (id(self.device), key) not in _PIPELINES), key=lambda item: -len(item[1].source))
        workers = min(len(missing), os.cpu_count() or 1, PIPELINE_THREADS)
        if workers > 1:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                list(pool.map(lambda item: self._pipeline(*item), missing))

    def _pipeline(self, key: str, kernel: KernelSource):
        hit = self._pipelines.get(key) or _PIPELINES.get((id(self.device), key))
        if hit is not None:
            self._pipelines[key] = hit
            return hit
        wgpu = self._wgpu
        dev = self.device
        types = {"read": wgpu.BufferBindingType.read_only_storage, "read_write": wgpu.BufferBindingType.storage}
        entries = [{"binding": 0, "visibility": wgpu.ShaderStage.COMPUTE,
                    "buffer": {"type": wgpu.BufferBindingType.uniform}}]
        for j, access in enumerate(kernel.bindings):
            entries.append({"binding": j + 1, "visibility": wgpu.ShaderStage.COMPUTE,
                            "buffer": {"type": types[access]}})
        try:
            module = shader_module(dev, kernel.name, kernel.source, shader_checks(kernel.guarded))
            bgl = dev.create_bind_group_layout(label=kernel.name, entries=entries)
            pl = dev.create_pipeline_layout(label=kernel.name, bind_group_layouts=[bgl])
            pipeline = dev.create_compute_pipeline(label=kernel.name, layout=pl,
                                                   compute={"module": module, "entry_point": "main"})
        except Exception as exc:  # a bug in generated WGSL, not a user error: keep the source at hand
            raise RuntimeError(f"kernel {kernel.name} failed to build: {exc}\n--- WGSL ---\n{kernel.source}") from exc
        self._pipelines[key] = _PIPELINES[(id(self.device), key)] = (pipeline, bgl)
        return pipeline, bgl

    def _locate(self, node_id: int) -> tuple[object, int]:
        """The GPU buffer holding a node's value and the byte offset of that value in it."""
        b, offset = self.plan.place(node_id)
        return self.buffers[b], self._bases[b] + offset

    def _write(self, node_id: int, arr: np.ndarray):
        """Upload ``arr`` as node ``node_id``'s value: a bf16 node's bits, taken before any
        copy into row order (``contiguous``; half the bytes where ``arr`` is a transpose)."""
        data = contiguous(bf16_bits(arr) if self.graph[node_id].dtype == "bf16" else arr)
        if self.graph[node_id].dtype == "bf16" and data.size % 2:   # whole 4-byte words, as WebGPU writes them
            data = np.concatenate([data.reshape(-1), np.zeros(1, np.uint16)])
        if data.nbytes:
            buffer, offset = self._locate(node_id)
            with device_guard("uploading a tensor", self.device):
                self.device.queue.write_buffer(buffer, offset, data)

    def _node_for(self, kind: str, name: str, table: Mapping[str, int]):
        if name not in table:
            known = ", ".join(sorted(table)) or "none"
            raise MeganeuraError(f"graph {self.graph.name!r} has no {kind} named {name!r} (its {kind}s: {known})")
        return self.graph[table[name]]

    def _upload(self, kind: str, name: str, array, table: Mapping[str, int]):
        node = self._node_for(kind, name, table)
        self._write(node.id, check_array(kind, name, array, node, copy=False))

    def _read(self, node) -> np.ndarray:
        if node.size == 0:
            return np.zeros(node.shape, dtype=_NP[node.dtype])
        buffer, offset = self._locate(node.id)
        with device_guard("reading a tensor back", self.device):
            raw = self.device.queue.read_buffer(buffer, offset, -(-node.nbytes // 4) * 4)
        if node.dtype == "bf16":
            bits = np.frombuffer(raw, np.uint16, count=node.size).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(node.shape)
        return np.frombuffer(raw, dtype=_NP[node.dtype], count=node.size).reshape(node.shape).copy()

    # ------------------------------------------------------------ public API

    @property
    def pipeline_count(self) -> int:
        return len(self._pipelines)

    @property
    def build_seconds(self) -> float:
        """Wall time of the build, from the first of ``build_spans`` to the end of the last."""
        return (self.build_spans[-1][2] - self.build_spans[0][1]) / 1e9

    @property
    def dispatch_count(self) -> int:
        """Dispatches a step records (``record``'s positions are 0..dispatch_count-1)."""
        return len(self._steps)

    def set_input(self, name: str, array) -> None:
        self._upload("input", name, array, self.graph.inputs)

    def set_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        for k, v in inputs.items():
            self.set_input(k, v)

    def set_parameter(self, name: str, array) -> None:
        self._upload("parameter", name, array, self.graph.parameters)

    def set_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        for k, v in params.items():
            self.set_parameter(k, v)

    def parameter_buffers(self) -> dict[str, tuple[object, int, int]]:
        """Where each parameter lives, (GPU buffer, byte offset, byte size), to share with
        another session (parameters of a training session's group share one buffer)."""
        out = {}
        for name, nid in self.graph.parameters.items():
            buffer, offset = self._locate(nid)
            out[name] = (buffer, offset, self.graph[nid].nbytes)
        return out

    def get_parameter(self, name: str) -> np.ndarray:
        return self._read(self._node_for("parameter", name, self.graph.parameters))

    def record(self, encoder, timestamps=None, dispatches=None) -> None:
        """Record the dispatches of one step into ``encoder``: all of them (or the
        positions in ``_steps`` listed in ``dispatches``) in one compute pass, ended
        after a dispatch the plan copies something after (the copy follows it).

        ``timestamps`` (an ``engine.profiler.DispatchTimestamps``) adds GPU timestamps
        around each dispatch: written inside the pass where the device allows it, else
        one compute pass per dispatch with the pass's timestamp writes."""
        positions = range(len(self._steps)) if dispatches is None else dispatches
        chunk: list[int] = []
        for pos in positions:
            chunk.append(pos)
            if pos in self._transfers_after:
                self._record_steps(encoder, "step", self._steps, chunk, timestamps)
                for t in self._transfers_after[pos]:
                    self._transfer(encoder, t)
                chunk = []
        if chunk:
            self._record_steps(encoder, "step", self._steps, chunk, timestamps)

    def _transfer(self, encoder, t: Transfer) -> None:
        encoder.copy_buffer_to_buffer(self.buffers[t.src], self._bases[t.src] + t.src_offset,
                                      self.buffers[t.dst], self._bases[t.dst] + t.dst_offset, t.nbytes)

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
        if timestamps is None:
            _dispatch_raw(cp, steps, positions)
        else:
            for i in positions:
                pipeline, bind_group, (x, y, z) = steps[i]
                timestamps.write(cp, i, 0)
                cp.set_pipeline(pipeline)
                cp.set_bind_group(0, bind_group)
                cp.dispatch_workgroups(x, y, z)
                timestamps.write(cp, i, 1)
        cp.end()

    def record_bracketed(self, encoder, timestamp_writes: dict, repeats: int = 1) -> None:
        """Record ``repeats`` runs of every dispatch into one compute pass whose
        ``timestamp_writes`` bracket them: a plan's GPU time as a step runs it, without
        the timestamps between dispatches that a profile writes (``meganeura tune``'s
        clock). A plan that copies between its dispatches needs several passes: refused."""
        if self._transfers_after:
            raise ValueError(f"{self.graph.name}: its plan copies between dispatches; time it with profile()")
        cp = encoder.begin_compute_pass(label="bracketed", timestamp_writes=timestamp_writes)
        for _ in range(repeats):
            _dispatch_raw(cp, self._steps, range(len(self._steps)))
        cp.end()

    def record_parts(self) -> list:
        """A step's command buffers, to be submitted in order (``submit``): its dispatches,
        with the plan's copies after them, on Dawn in ``submission_chunks``; whole on
        wgpu-native, which does its share when the commands are encoded (a training step
        records the next step's while this one runs: there parts gained nothing and cost
        up to 0.1 ms a step)."""
        n = len(self._steps)
        chunks = submission_chunks(n) if backend() == "dawn" else [range(n)]
        parts = []
        for chunk in chunks:
            enc = self.device.create_command_encoder(label=f"step {chunk.start}-{chunk.stop}")
            self.record(enc, dispatches=chunk)
            parts.append(enc.finish())
        return parts

    def submit(self, parts) -> None:
        """Submit ``record_parts``' command buffers one by one: the GPU runs a part while the
        next is submitted."""
        for part in parts:
            self.device.queue.submit([part])

    def run(self) -> None:
        """Record every dispatch and submit (no wait)."""
        with device_guard("running a step", self.device):
            self.submit(self.record_parts())

    def profile(self, steps: int = 10, train: bool = False, **options):
        """Run ``steps`` steps with GPU timestamps around every dispatch; returns an
        ``engine.profiler.ProfileReport`` (see ``engine.profiler.profile_session``)."""
        from .profiler import profile_session
        return profile_session(self, steps, train=train, **options)

    def output_location(self, name: str) -> tuple[object, int, int]:
        """(GPU buffer, byte offset, byte size) of an output, to copy it within a step's
        own command encoder (generation reads its logits that way)."""
        node = self._node_for("output", name, self.graph.outputs)
        buffer, offset = self._locate(node.id)
        return buffer, offset, node.nbytes

    def input_location(self, name: str) -> tuple[object, int, int]:
        """(GPU buffer, byte offset, byte size) of an input, to fill it within a command
        encoder (greedy generation copies each step's chosen id there)."""
        node = self._node_for("input", name, self.graph.inputs)
        buffer, offset = self._locate(node.id)
        return buffer, offset, node.nbytes

    def read_output(self, name: str) -> np.ndarray:
        return self._read(self._node_for("output", name, self.graph.outputs))

    def read_outputs(self) -> dict[str, np.ndarray]:
        return {k: self.read_output(k) for k in self.graph.outputs}

    def read_loss(self) -> float:
        """The scalar loss output (the plan's, else ``loss``; waits for the submitted work)."""
        name = self.plan.loss or "loss"
        if name not in self.graph.outputs:
            raise MeganeuraError(f"graph {self.graph.name!r} has no {name!r} output")
        with device_guard("reading the loss", self.device):
            return float(self.read_output(name).reshape(-1)[0])


def _dispatch_raw(compute_pass, steps, positions) -> None:
    """``steps[i]`` for each ``i`` in ``positions``, recorded through the backend's C
    functions (webgpu.h's, the same in wgpu-native and Dawn) directly: wgpu-py's
    wrappers cost ~2 us a call here (and a dispatch takes three), the driver's part is
    the rest. Nothing is lost: a pass's validation errors are deferred to its end(),
    which still goes through wgpu-py."""
    api = native_api()
    ffi, lib = api.ffi, api.lib
    handle, null = compute_pass._internal, ffi.NULL
    set_pipeline = lib.wgpuComputePassEncoderSetPipeline
    set_bind_group = lib.wgpuComputePassEncoderSetBindGroup
    dispatch = lib.wgpuComputePassEncoderDispatchWorkgroups
    for i in positions:
        pipeline, bind_group, (x, y, z) = steps[i]
        set_pipeline(handle, pipeline._internal)
        set_bind_group(handle, 0, bind_group._internal, 0, null)
        dispatch(handle, x, y, z)


def build_inference_session(graph: Graph, plan: ExecutionPlan | None = None, share_with: Session | None = None,
                            optimize: bool = True, capabilities: codegen.Capabilities | None = None) -> Session:
    """A Session running ``graph`` forward on the default device, fused by
    ``engine.optimize`` (through the on-disk cache) unless ``optimize=False`` (or a plan
    is given), compiled for the device's capabilities. With ``share_with`` (e.g. a
    training session of the same model at another batch size) it uses that session's
    parameter buffers: every update the other session makes is seen here, with no copy."""
    shared = share_with.parameter_buffers() if share_with is not None else None
    device = share_with.device if share_with is not None else get_device()
    start = time.perf_counter_ns()
    if optimize and plan is None:
        graph, _ = cached_optimize(graph)
    if plan is None:
        plan = cached_plan(graph, loss="loss", capabilities=capabilities or device_capabilities(device),
                           pack_parameters=share_with is None)
    prepared = time.perf_counter_ns()
    session = Session(graph, plan, device, shared)
    session.build_spans.insert(0, ("optimize and compile plan", start, prepared))
    return session
