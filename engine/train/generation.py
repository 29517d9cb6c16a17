"""Generating tokens from a causal language model with a KV cache.

The prompt runs once through a prefill graph that writes the cache; each new token runs
a one-token decode graph that appends to the cache and attends over it (both built by
the model, ``engine.graph.kv_cache``). On the GPU both are compiled plans built once
per cache capacity (and padded prompt length, for the prefill): the decode session owns the
weights (those a bf16 checkpoint stored, in bf16: engine.optimize.bf16_weights) and the
caches, the prefill session shares them, and a decode step uploads
two ints, records the plan's dispatches, copies the last logits into a mapped buffer
kept for the purpose and reads them: it allocates nothing. On the reference backend
the same graphs run in numpy, the caches passed from one step's outputs to the next.

Sampling happens on the host from the last position's logits (engine.train.sampling). Greedy
decoding on the GPU does not come back to the host between steps: each decode step also
takes its logits' argmax (the graph's ``next_id``), copied on the GPU into the next step's
token input, so the host records steps ahead while the GPU runs and reads their ids a
batch at a time (``_GpuSteps.greedy``; a 30-layer model's step is GPU-bound at ~1.5 ms
on an H100, and waiting for each token's logits left the GPU idle a third of the time).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from ..errors import MeganeuraError
from ..graph.kv_cache import CACHE_PREFIX, LAST, NEXT_ID
from ..optimize.bf16_weights import (bf16_candidates, direct_readers, keep_out_in, store_weights_bf16,
                                     transposable)
from .sampling import Sampling, unusable_logits

MIN_CAPACITY = 256
PREFILL_ROUND = 64   # a GPU prefill runs its prompt padded to a multiple of this many tokens
MAX_PREFILLS = 4     # prefill sessions (one per padded prompt length) a generator keeps
GREEDY_BATCH = 8     # greedy decode steps the host reads back at once (two batches in flight)


# ---------------------------------------------------------------- results

@dataclass
class Generation:
    """One call's prompt and new ids, why it stopped (``"eos"``, ``"length"`` or
    ``"cancelled"``) and its timings: building what it runs, the prefill (prompt in, first
    token out) and each decode step, wall clock with the read-back of its logits."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    stopped: str = "length"
    build_seconds: float = 0.0   # building the sessions (graphs) this call needed; 0 where an earlier call did
    prefill_seconds: float = 0.0
    per_token_ms: list[float] = field(default_factory=list)
    capacity: int = 0

    @property
    def decode_tokens_per_second(self) -> float | None:
        total = sum(self.per_token_ms)
        return 1000.0 * len(self.per_token_ms) / total if total > 0 else None


def cache_capacity(tokens: int, context_length: int) -> int:
    """Cache rows for a sequence of ``tokens``: a power of two of at least MIN_CAPACITY
    (a later, slightly longer request reuses the compiled sessions), at most the context."""
    return min(context_length, max(MIN_CAPACITY, 1 << max(tokens - 1, 0).bit_length()))


# ---------------------------------------------------------------- executors

class _ReferenceSteps:
    """The generation graphs on the numpy reference executor."""

    def __init__(self, model, params: Mapping[str, np.ndarray], capacity: int):
        from ..arrays import contiguous
        self.model, self.capacity = model, capacity
        self.params = {k: contiguous(v) for k, v in params.items()}   # each step copies them: once out of order here
        self.caches: dict[str, np.ndarray] = {}
        self.graphs: dict[tuple[int, bool], object] = {}   # (tokens, prefill) -> graph, built once

    def graph(self, tokens: int, prefill: bool):
        if (tokens, prefill) not in self.graphs:
            self.graphs[tokens, prefill] = self.model.generation_graph(tokens, self.capacity, prefill)
        return self.graphs[tokens, prefill]

    def prepare(self, prompt_tokens: int) -> bool:
        """Build the graphs a generation from a prompt of ``prompt_tokens`` runs; whether any was new."""
        built = len(self.graphs)
        self.graph(prompt_tokens, True)
        self.graph(1, False)
        return len(self.graphs) > built

    def run(self, ids: Sequence[int], start: int, prefill: bool) -> np.ndarray:
        from ..graph import reference
        graph = self.graph(len(ids), prefill)
        for name in graph.parameters:
            if name.startswith(CACHE_PREFIX) and name not in self.caches:
                self.caches[name] = np.zeros(graph.shape(graph.parameters[name]), np.float32)
        inputs = prefill_inputs(self.model, ids, len(ids)) if prefill else step_inputs(self.model, ids, start)
        out = reference.run(graph, inputs, {**self.params, **self.caches})
        self.caches.update({k: v for k, v in out.items() if k.startswith(CACHE_PREFIX)})
        return out["logits"].reshape(-1)

    def sampled(self, sampling: Sampling, rng, token: int, start: int, count: int) -> Iterator[tuple[int, float]]:
        """(id, wall ms) of ``count`` decode steps after ``token`` at position ``start``, each
        chosen from the last one's logits."""
        for j in range(count):
            t0 = time.perf_counter()
            token = sampling.choose(self.run([token], start + j, prefill=False), rng, decode_step(j, start))
            yield token, 1000.0 * (time.perf_counter() - t0)


class _GpuSteps:
    """The generation graphs as GPU sessions: a decode session per capacity owning the
    weights and caches, prefill sessions per padded prompt length (``prefill_length``)
    sharing them."""

    def __init__(self, model, params: Mapping[str, np.ndarray], capacity: int):
        from ..codegen import reads_bf16
        from ..runtime.device import device_capabilities, get_device
        self.model, self.capacity = model, capacity
        caps = device_capabilities(get_device())
        self._reads_bf16 = lambda graph, node, i: reads_bf16(graph, node, i, caps)
        self.bf16: set[str] = set()   # the weights kept in bf16 (engine.optimize.bf16_weights)
        self.transposed: set[str] = set()   # ... and those kept [out, in]
        step = model.generation_graph(1, capacity, prefill=False)
        used = {k: v for k, v in params.items() if k in step.parameters}
        if caps.knobs.weight_layout == "out-in":
            self.transposed = transposable(step, used)
        decode = self._optimized(step)
        if caps.knobs.bf16_weights:
            self.bf16 = direct_readers(decode, bf16_candidates(used), self._reads_bf16)
        self.decode = self._build(decode)
        self.decode.set_parameters({k: v.T if k in self.transposed else v for k, v in used.items()
                                    if k in self.decode.graph.parameters})
        self.prefills: dict[int, object] = {}
        self.readback = self._readback_buffer(self.decode)
        self.id_readbacks = None   # greedy's two batches of ids in flight, made on first use

    def _optimized(self, graph):
        from ..compile.cache import cached_generation_graph
        return cached_generation_graph(keep_out_in(graph, self.transposed))[0]

    def _build(self, graph, share_with=None):
        """A session of an optimized generation graph, the weights in ``bf16`` stored so
        (those in ``transposed`` are kept [out, in] by the graph already: ``_optimized``)."""
        from ..runtime.session import build_inference_session
        graph, _ = store_weights_bf16(graph, self.bf16, self._reads_bf16)
        return build_inference_session(graph, share_with=share_with, optimize=False)

    def _readback_buffer(self, session):
        from ..runtime.device import wgpu_module
        wgpu = wgpu_module()
        nbytes = session.graph[session.graph.outputs["logits"]].nbytes
        return session.device.create_buffer(label="logits read-back", size=-(-nbytes // 16) * 16,
                                            usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)

    def prefill_length(self, prompt_tokens: int) -> int:
        return prefill_length(prompt_tokens, self.capacity, self.model.context_length)

    def session(self, seq: int, prefill: bool):
        """The decode session, or the prefill session that runs a prompt of ``seq`` tokens."""
        if not prefill:
            return self.decode
        tokens = self.prefill_length(seq)
        if tokens not in self.prefills:
            if len(self.prefills) >= MAX_PREFILLS:   # each holds its own intermediates: keep the recent ones
                del self.prefills[next(iter(self.prefills))]
            graph = self._optimized(self.model.generation_graph(tokens, self.capacity, prefill=True))
            self.prefills[tokens] = self._build(graph, share_with=self.decode)
        return self.prefills[tokens]

    def prepare(self, prompt_tokens: int) -> bool:
        """Build the prefill session for a prompt of ``prompt_tokens`` (the decode one is built);
        whether it was new."""
        built = self.prefill_length(prompt_tokens) not in self.prefills
        self.session(prompt_tokens, True)
        return built

    def run(self, ids: Sequence[int], start: int, prefill: bool) -> np.ndarray:
        """The logits of a prefill of prompt ``ids`` (``start`` 0) or of a decode step."""
        session = self.session(len(ids), prefill)
        inputs = (prefill_inputs(self.model, ids, self.prefill_length(len(ids))) if prefill
                  else step_inputs(self.model, ids, start))
        return run_step(session, inputs, self.readback)

    def sampled(self, sampling: Sampling, rng, token: int, start: int, count: int) -> Iterator[tuple[int, float]]:
        """(id, wall ms) of ``count`` decode steps after ``token`` at position ``start``, each
        chosen on the host from the last one's logits, with the next step's commands
        recorded while the GPU runs this one (recording a Llama-3.2-1B step's 179 dispatches
        took 0.58 ms on the H100's host, and the GPU waited for it). Stopping early drops the
        recorded step unsubmitted."""
        from ..runtime.device import device_guard
        session = self.decode
        with device_guard("running sampled decode steps", session.device):
            ahead = list(step_commands(session, self.readback))
            for j in range(count):
                t0 = time.perf_counter()
                session.set_inputs(step_inputs(self.model, [token], start + j))
                session.device.queue.submit(ahead)
                ahead = list(step_commands(session, self.readback)) if j + 1 < count else []
                token = sampling.choose(read_logits(session, self.readback), rng, decode_step(j, start))
                yield token, 1000.0 * (time.perf_counter() - t0)

    def greedy(self, token: int, start: int, count: int) -> Iterator[tuple[list[int], float]]:
        """``count`` greedy decode steps from ``token`` at position ``start``, run back to back:
        a step's ``next_id`` is copied on the GPU into the next step's token input and into
        a read-back slot, and the host reads GREEDY_BATCH ids at a time while the GPU runs
        the next batch. Yields each batch's ids and the wall milliseconds a token took (the
        last two batches together). Stopping early (EOS, cancel) leaves at most a batch run
        for nothing."""
        from ..runtime.device import device_guard, wgpu_module
        wgpu, session = wgpu_module(), self.decode
        device = session.device
        if self.id_readbacks is None:
            self.id_readbacks = [device.create_buffer(label=f"greedy ids {i}", size=4 * GREEDY_BATCH,
                                                      usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
                                 for i in range(2)]
        ids_at = session.input_location(self.model.token_input)[:2]
        chosen_at = session.output_location(NEXT_ID)[:2]
        sizes = [min(GREEDY_BATCH, count - i) for i in range(0, count, GREEDY_BATCH)]
        inflight: list[tuple[object, int]] = []
        produced = 0
        last = time.perf_counter()
        with device_guard("running greedy decode steps", device):
            session.set_input(self.model.token_input, np.array([[token]], np.int32))
            for b, size in enumerate(sizes):
                readback = self.id_readbacks[b % 2]
                for k in range(size):
                    session.set_input("positions", np.array([[start + b * GREEDY_BATCH + k]], np.int32))
                    encoder = device.create_command_encoder(label="greedy decode step")
                    session.record(encoder)
                    encoder.copy_buffer_to_buffer(*chosen_at, *ids_at, 4)
                    encoder.copy_buffer_to_buffer(*chosen_at, readback, 4 * k, 4)
                    device.queue.submit([encoder.finish()])
                inflight.append((readback, size))
                if b == len(sizes) - 1:   # the last two together: the last is done by the time the other is read
                    done, inflight = inflight, []
                elif len(inflight) == 2:
                    done = [inflight.pop(0)]
                else:
                    continue
                ids = [i for readback, n in done for i in _read_ids(readback, n)]
                if -1 in ids:   # the argmax's mark of logits holding a NaN or +inf
                    raise unusable_logits(decode_step(produced + ids.index(-1), start), "they hold")
                produced += len(ids)
                now = time.perf_counter()
                yield ids, 1000.0 * (now - last) / len(ids)
                last = now


def _read_ids(readback, count: int) -> list[int]:
    from ..runtime.device import wgpu_module
    readback.map_sync(wgpu_module().MapMode.READ, 0, readback.size)
    try:
        return np.frombuffer(readback.read_mapped(0, 4 * count), np.int32).tolist()
    finally:
        readback.unmap()


def run_step(session, inputs: Mapping[str, np.ndarray], readback) -> np.ndarray:
    """Upload ``inputs``, run the session's plan and read its ``logits`` through ``readback``
    (a MAP_READ buffer): a few submissions, one wait, nothing allocated."""
    from ..runtime.device import device_guard
    session.set_inputs(inputs)
    with device_guard("running a generation step", session.device):
        for commands in step_commands(session, readback):   # each chunk runs while the next is recorded
            session.device.queue.submit([commands])
        return read_logits(session, readback)


def step_commands(session, readback) -> Iterator[object]:
    """The command buffers of one run of ``session``'s plan, in chunks
    (``submission_chunks``), the last also copying the logits into ``readback``. They
    read the inputs as they are when submitted, so they can be recorded ahead."""
    from ..runtime.session import submission_chunks
    buffer, offset, nbytes = session.output_location("logits")
    chunks = submission_chunks(session.dispatch_count)
    for i, chunk in enumerate(chunks):
        encoder = session.device.create_command_encoder(label="generation step")
        session.record(encoder, dispatches=chunk)
        if i == len(chunks) - 1:
            encoder.copy_buffer_to_buffer(buffer, offset, readback, 0, -(-nbytes // 4) * 4)
        yield encoder.finish()


def read_logits(session, readback) -> np.ndarray:
    """The logits a step copied into ``readback``, once the GPU is done with it."""
    from ..runtime.device import wgpu_module
    nbytes = session.output_location("logits")[2]
    readback.map_sync(wgpu_module().MapMode.READ, 0, readback.size)
    try:
        raw = readback.read_mapped(0, nbytes)
    finally:
        readback.unmap()
    return np.frombuffer(raw, np.float32).copy()


def decode_step(j: int, start: int) -> str:
    """How an error names decode step ``j`` of those after a prompt of ``start`` tokens."""
    return f"the logits of new token {j + 2} (position {start + j})"


def step_inputs(model, ids: Sequence[int], start: int) -> dict[str, np.ndarray]:
    ids = np.asarray(ids, np.int32).reshape(1, -1)
    positions = np.arange(start, start + ids.shape[1], dtype=np.int32).reshape(1, -1)
    return {model.token_input: ids, "positions": positions}


def prefill_inputs(model, prompt: Sequence[int], tokens: int) -> dict[str, np.ndarray]:
    """A prefill graph of ``tokens`` tokens' inputs for ``prompt``: padded at its end with id
    0, and ``last``, the prompt's last row, whose logits the graph gives."""
    padded = [int(t) for t in prompt] + [0] * (tokens - len(prompt))
    return {**step_inputs(model, padded, 0), LAST: np.array([[len(prompt) - 1]], np.int32)}


def prefill_length(prompt_tokens: int, capacity: int, context_length: int) -> int:
    """Tokens a GPU prefill of a prompt runs: its length rounded up to PREFILL_ROUND (at most
    the cache's rows and the context), so that prompts of nearby lengths share one compiled
    session instead of each optimizing and compiling its own (0.4-0.9 s for SmolLM2 on the
    CI host). The padding follows the prompt, so causal attention keeps it out of the
    prompt's rows; the cache rows it writes lie past the prompt, where each decode step
    writes its own row before it reads any."""
    return max(prompt_tokens, min(-(-prompt_tokens // PREFILL_ROUND) * PREFILL_ROUND, capacity, context_length))


def decode_stream(steps, sampling: Sampling, rng, token: int, start: int, count: int, ahead: bool):
    """(id, wall ms) of the ``count`` decode steps after ``token`` at position ``start``:
    ``ahead`` (greedy on the GPU), in batches run ahead (``_GpuSteps.greedy``), else one
    step each time the next is asked for."""
    if ahead:
        for ids, ms in steps.greedy(token, start, count):
            yield from ((t, ms) for t in ids)
        return
    yield from steps.sampled(sampling, rng, token, start, count)


# ---------------------------------------------------------------- the generator

class Generator:
    """Generation from one model and its parameters; keeps its compiled sessions across
    calls (the Studio generates again and again from one model)."""

    def __init__(self, model, params: Mapping[str, np.ndarray] | None = None, backend: str = "gpu"):
        if backend not in ("gpu", "reference"):
            raise MeganeuraError(f"backend {backend!r} is not one of gpu, reference")
        self.model, self.backend = model, backend
        self.params = dict(model.init_params() if params is None else params)
        self._steps: dict[int, object] = {}

    def steps(self, capacity: int):
        if capacity not in self._steps:
            kind = _GpuSteps if self.backend == "gpu" else _ReferenceSteps
            self._steps = {capacity: kind(self.model, self.params, capacity)}  # one capacity's buffers at a time
        return self._steps[capacity]

    def bf16_weights(self) -> set[str]:
        """The weights the GPU sessions keep in bf16, as the checkpoint stored them
        (engine.optimize.bf16_weights); none on the reference backend or before a generation."""
        return set().union(*(getattr(steps, "bf16", set()) for steps in self._steps.values()))

    def runs_ahead(self, sampling: Sampling) -> bool:
        """Whether decoding runs ahead on the GPU (greedy there): the ids then come back
        GREEDY_BATCH at a time, each with its batch's wall ms a token."""
        return self.backend == "gpu" and sampling.temperature == 0

    def check(self, prompt: Sequence[int], max_new_tokens: int) -> int:
        """The cache capacity for the request, after checking it against the model."""
        vocab, context = self.model.vocab_size, self.model.context_length
        if not prompt:
            raise MeganeuraError("the prompt is empty; give at least one token")
        bad = [int(t) for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise MeganeuraError(f"prompt ids {bad[:5]} lie outside the vocabulary of {vocab}")
        if max_new_tokens < 1:
            raise MeganeuraError(f"max-new-tokens must be at least 1, found {max_new_tokens}")
        total = len(prompt) + max_new_tokens
        if total > context:
            raise MeganeuraError(f"prompt ({len(prompt)} tokens) plus {max_new_tokens} new tokens is {total}, over "
                                 f"the model's context length of {context}; shorten the prompt or generate fewer")
        return cache_capacity(total, context)

    def generate(self, prompt: Sequence[int], max_new_tokens: int = 32, sampling: Sampling = Sampling(),
                 eos_ids: Sequence[int] = (), on_token: Callable[[int, float], None] | None = None,
                 should_stop: Callable[[], bool] | threading.Event | None = None) -> Generation:
        """New ids after ``prompt``, up to ``max_new_tokens`` or an id in ``eos_ids`` (kept
        as the last token). ``on_token(id, milliseconds)`` sees each as it comes;
        ``should_stop`` is checked before each token after the first (greedy decoding on
        the GPU runs up to two batches ahead; what it ran past a stop is dropped)."""
        prompt = [int(t) for t in prompt]
        capacity = self.check(prompt, max_new_tokens)
        start, built = time.perf_counter(), capacity not in self._steps
        steps = self.steps(capacity)
        built = steps.prepare(len(prompt)) or built
        stop = should_stop.is_set if isinstance(should_stop, threading.Event) else should_stop
        rng = np.random.default_rng(sampling.seed)
        result = Generation(prompt, capacity=steps.capacity, build_seconds=(time.perf_counter() - start) * built)
        start = time.perf_counter()
        token = sampling.choose(steps.run(prompt, 0, prefill=True), rng, "the prompt's logits (new token 1)")
        result.prefill_seconds = time.perf_counter() - start
        eos = {int(e) for e in eos_ids}
        later = decode_stream(steps, sampling, rng, token, len(prompt), max_new_tokens - 1, self.runs_ahead(sampling))
        ms = 1000.0 * result.prefill_seconds
        while True:
            result.tokens.append(token)
            if on_token:
                on_token(token, ms)
            if token in eos:
                result.stopped = "eos"
                break
            if len(result.tokens) >= max_new_tokens:
                break
            if stop and stop():
                result.stopped = "cancelled"
                break
            token, ms = next(later)
            result.per_token_ms.append(ms)
        later.close()
        return result
