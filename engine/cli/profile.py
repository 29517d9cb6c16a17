"""``meganeura profile MODEL``: per-dispatch GPU times of a model's step.

Builds the model's graph, compiles it, builds a GPU session (each phase a CPU span),
runs ``--steps`` profiled steps (``engine.profiler.profile_session``) and prints the
top kernels like torch.profiler's ``key_averages()`` table, or with ``--json`` one
object (docs/cli.md). ``--trace OUT.pftrace`` writes a Perfetto trace (``.json``: a
Chrome trace). Progress goes to stderr, one line per step.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from .registry import at_least_one, register_command
from .commands import _model_arguments, _print_json, load_model, loss_arguments, progress
from ..errors import MeganeuraError
from ..train.generation import prefill_inputs, step_inputs


def _profile_arguments(parser: argparse.ArgumentParser) -> None:
    _model_arguments(parser)
    parser.add_argument("--steps", type=int, default=10, help="profiled steps (default 10)")
    parser.add_argument("--warmup", type=int, default=1, metavar="N",
                        help="untimed steps before the profiled ones, forward or training (default 1; 0 "
                             "profiles the first step, which pays for first-use costs)")
    parser.add_argument("--train", action="store_true",
                        help="profile training steps (forward, backward, optimizer) instead of the forward pass")
    parser.add_argument("--generate", type=int, metavar="N",
                        help="profile generation instead (causal LMs): the prefill of a prompt of the model's "
                             "seq tokens, then N decode steps over the KV cache; tables and traces show the "
                             "two phases apart")
    loss_arguments(parser)
    parser.add_argument("--trace", metavar="OUT.pftrace",
                        help="write a Perfetto trace here (a name ending in .json writes Chrome trace JSON)")
    parser.add_argument("--top", type=at_least_one, default=15, help="kernels shown in the table (default 15)")
    parser.add_argument("--group-by", choices=("kernel", "archetype", "module"), default="kernel",
                        help="table rows: per kernel (default), per kernel archetype, or per module "
                             "(the model's layers and the modules beside them, in model order)")
    parser.add_argument("--timing", choices=("auto", "inside-passes", "per-pass", "cpu-wall-per-submission"),
                        default="auto", help="how dispatches are timed (default: the best the adapter offers)")


def profile_model(args, spans=None):
    """Build ``args.model`` on the GPU and profile it; returns the ProfileReport."""
    from ..runtime.report import SpanRecorder

    if args.steps < 1:
        raise MeganeuraError(f"--steps must be at least 1, found {args.steps}")
    if args.warmup < 0:
        raise MeganeuraError(f"--warmup must be 0 or more, found {args.warmup}")
    rec = spans if spans is not None else SpanRecorder()
    with rec.span(f"meganeura profile {args.model}"):
        with rec.span("load model"):
            model, params = load_model(args)
        mode = None if args.timing == "auto" else args.timing
        if args.generate is not None:
            if args.train:
                raise MeganeuraError("--generate and --train profile different things; give one of them")
            report = profile_generation(model, params, args.generate, mode=mode, spans=rec, progress=progress)
        else:
            report, _ = profile_built_model(model, params, args.steps, train=bool(args.train), seed=args.seed,
                                            mode=mode, spans=rec, progress=progress, warmup=args.warmup)
    report.spans = list(rec.spans)  # the outer span closed after the report was made
    return report


def profile_built_model(model, params, steps: int, *, train: bool = False, graph=None, seed: int = 0,
                        mode: str | None = None, spans=None, progress=None, warmup: int = 1):
    """Profile ``steps`` steps of a configured built-in model on the GPU, after ``warmup``
    untimed ones; returns ``(ProfileReport, session)``. The CLI and the Studio share it.
    ``graph``: the already optimized forward graph to run (inference only; by default the
    model's graph is built and optimized here). ``progress`` gets one line per phase and per step (raising in it
    cancels the run)."""
    from ..compile.cache import cached_optimize, cached_plan
    from ..runtime import session as runtime
    from ..runtime.report import SpanRecorder, add_build_spans
    from ..runtime.peaks import adapter_peaks
    from ..runtime.profiler import profile_session

    if steps < 1:
        raise MeganeuraError(f"--steps must be at least 1, found {steps}")
    say = progress or (lambda message: None)
    rec = spans if spans is not None else SpanRecorder()
    optimized = graph is not None and not train
    with rec.span("build graph", train=bool(train)):
        if not optimized:
            graph = model.build(train=bool(train))
    say(f"profiling {model.name} ({'training' if train else 'forward'} step, "
        f"{len(graph.nodes)} nodes) for {steps} steps")
    runtime.get_device()   # the process's device, before the build is timed
    start = time.perf_counter()
    if train:
        from ..train.config import TrainConfig
        from ..train.session import build_session
        config = TrainConfig(**model.TRAIN_DEFAULTS, batch_size=model.batch_size(), seed=seed)
        with rec.span("build training session (optimize, differentiate, optimize, compile)"):
            session = build_session(graph, config)
            add_build_spans(rec, session)
    else:
        if not optimized:
            with rec.span("optimize"):
                graph, _ = cached_optimize(graph)
        with rec.span("compile plan"):
            plan = cached_plan(graph, loss="loss", capabilities=runtime.device_capabilities())
        session = runtime.build_inference_session(graph, plan)
        add_build_spans(rec, session)
    build_seconds = time.perf_counter() - start
    with rec.span("upload parameters and inputs"):
        session.set_parameters({k: v for k, v in params.items() if k in graph.parameters})
        inputs = model.example_inputs(train=bool(train), seed=seed)
        session.set_inputs({k: v for k, v in inputs.items() if k in graph.inputs})
    report = profile_session(session, steps, train=bool(train), model=model.name, mode=mode,
                             spans=rec, include_build_spans=False, progress=progress, warmup=warmup)
    report.build_seconds = build_seconds
    with rec.span("adapter peaks (roofline)"):
        report.peaks = adapter_peaks(session.device, progress=say)
    return report, session


def profile_generation(model, params, new_tokens: int, *, prompt=None, mode: str | None = None, spans=None,
                       progress=None):
    """Profile a generation on the GPU: the prefill of ``prompt`` (default: the model's
    ``seq`` setting's worth of its example tokens) once, then ``new_tokens`` decode steps
    at successive positions; one ProfileReport whose dispatches carry their phase
    (``prefill`` or ``decode``: separate table rows and trace tracks)."""
    from ..runtime.peaks import adapter_peaks
    from ..runtime.profiler import profile_session
    from ..runtime.report import SpanRecorder, combine_phases

    if new_tokens < 1:
        raise MeganeuraError(f"--generate must be at least 1, found {new_tokens}")
    say = progress or (lambda message: None)
    rec = spans if spans is not None else SpanRecorder()
    decode_positions = 2 * new_tokens + 2  # warm-up and the steps without timestamps advance too
    room = model.context_length - decode_positions
    if room < 1:
        raise MeganeuraError(f"--generate {new_tokens} runs {decode_positions} decode steps (the timed ones, their "
                             f"warm-up and untimed passes), which leaves no room for a prompt in {model.name}'s "
                             f"context of {model.context_length}; give at most {(model.context_length - 3) // 2}")
    gen = model.generator(params, backend="gpu")
    if prompt is None:
        seq = int(model.settings.get("seq", 16))
        if seq > room:
            say(f"the prompt is cut to {room} of seq={seq} tokens: {new_tokens} profiled decode steps advance the "
                f"cache {decode_positions} positions (warm-up and untimed passes too) in a context of "
                f"{model.context_length}")
        example = model.example_inputs(batch=1, seed=0)[model.token_input]
        prompt = [int(t) for t in np.asarray(example).reshape(-1)[:max(min(seq, room), 1)]]
    elif len(prompt) > room:
        raise MeganeuraError(f"a prompt of {len(prompt)} tokens and {new_tokens} profiled decode steps, which "
                             f"advance the cache {decode_positions} positions (warm-up and untimed passes too), "
                             f"need {len(prompt) + decode_positions} of {model.name}'s context of {model.context_length}")
    with rec.span("build generation sessions (optimize, compile)"):
        steps = gen.steps(gen.check(prompt, decode_positions))
        prefill = steps.session(len(prompt), prefill=True)
    tokens = steps.prefill_length(len(prompt))
    padded = f" (run as {tokens}, padded)" if tokens > len(prompt) else ""
    say(f"profiling {model.name}: prefill of {len(prompt)} tokens{padded}, then {new_tokens} decode steps")
    prefill.set_inputs(prefill_inputs(model, prompt, tokens))
    first = profile_session(prefill, 1, model=model.name, mode=mode, spans=rec, include_build_spans=False,
                            progress=progress)
    position = iter(range(len(prompt), len(prompt) + decode_positions + 1))
    decode = steps.decode
    decode.prepare_step = lambda: decode.set_inputs(step_inputs(model, prompt[-1:], next(position)))
    try:
        rest = profile_session(decode, new_tokens, model=model.name, mode=mode, spans=rec,
                               include_build_spans=False, progress=progress)
    finally:
        del decode.prepare_step
    report = combine_phases([("prefill", first), ("decode", rest)])
    with rec.span("adapter peaks (roofline)"):
        report.peaks = adapter_peaks(decode.device, progress=say)
    return report


def _profile(args) -> int:
    from ..runtime.profiler import write_trace

    report = profile_model(args)
    if args.trace:
        write_trace(report, args.trace)
        progress(f"trace written to {args.trace}")
    if args.json:
        _print_json(report.to_dict())
    else:
        a = report.adapter
        print(f"{report.model} on {a['name']} ({a['backend']}), {report.steps} steps, timing: {report.mode}")
        print(report.format_table(top=args.top, by=args.group_by))
    return 0


register_command("profile", "per-dispatch GPU times of a model's step, and a Perfetto trace",
                 _profile_arguments, _profile, outputs=("trace",))
