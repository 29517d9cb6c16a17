"""The model subcommands of ``meganeura``: models, run, optimize (train is in ``train``).

Each is a thin layer over the engine's public API; ``--json`` prints one object on
stdout (docs/cli.md documents the fields) and progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

import numpy as np

from .. import config, models
from .registry import register_command
from ..errors import InputError, MeganeuraError
from ..files import json_text, write_atomically


def _model_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("model", metavar="SOURCE", nargs=None if required else "?",
                        help="a built-in model name (see `meganeura models`), an .onnx file or a Hugging Face "
                             "checkpoint folder (config.json + model.safetensors)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                        help="model setting, e.g. --set batch=8 (repeatable)")
    parser.add_argument("--weights", metavar="FILE", help="weights (.safetensors) to load")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and data")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--precision", choices=("f32", "f16"),
                        help="matmul operands: f32 (default) or f16 on the GPU's cooperative-matrix units, "
                             "accumulating in f32 (needs MEGANEURA_WGPU=dawn and a GPU that has them; "
                             "elsewhere f32; there f32 runs on those units too, as three f16 products); "
                             "overrides MEGANEURA_PRECISION")


def open_model(args) -> models.BuiltinModel:
    """The model SOURCE names, configured by --set (and --precision, --loss, --target)."""
    from ..importers import load_model as import_model
    if getattr(args, "precision", None):
        config.use(replace(config.current(), precision=args.precision))
    options = {k: getattr(args, k) for k in ("loss", "target") if getattr(args, k, None)}
    return import_model(args.model, args.settings, progress=weights_progress(args.model), **options)


def weights_progress(source: str):
    """On a terminal, a line on stderr that follows a checkpoint's weights as they are read
    (a 1B-parameter one takes seconds); elsewhere (a pipe, a log) nothing."""
    if not sys.stderr.isatty():
        return None
    name = os.path.basename(str(source).rstrip("/")) or str(source)

    def show(done: int, total: int) -> None:
        end = "\n" if done >= total else ""
        print(f"\rreading the weights of {name}: {done / 2**30:.2f} of {total / 2**30:.2f} GiB",
              end=end, file=sys.stderr, flush=True)
    return show


def load_model(args) -> tuple[models.BuiltinModel, dict[str, np.ndarray]]:
    """The configured model and its parameters: from --weights, else an imported model's
    own, else freshly initialised with --seed."""
    from ..train.config import check_seed
    check_seed(args.seed)
    model = open_model(args)
    params = model.load_weights(args.weights) if args.weights else model.init_params(args.seed)
    return model, params


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _print_json(obj) -> None:
    print(json_text(obj))


# ------------------------------------------------------------------ models

def _models_arguments(parser):
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _models(args):
    table = {name: {"description": cls.description, "settings": cls.describe_settings()}
             for name, cls in models.REGISTRY.items()}
    if args.json:
        _print_json({"models": table})
        return 0
    for name, info in table.items():
        print(f"{name:<14}{info['description']}")
        for key, s in info["settings"].items():
            print(f"    {'--set ' + key + '=' + str(s['default']):<26}{s['help']}")
    return 0


register_command("models", "list the built-in models and their settings", _models_arguments, _models)


# ------------------------------------------------------------------ run

def _input_files(pairs) -> dict[str, str]:
    """``--input NAME=FILE`` pairs as name -> file. A name given twice is refused (all of
    them named): a dict would keep the last file without a word."""
    files: dict[str, str] = {}
    repeated: list[str] = []
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep:
            raise MeganeuraError(f"--input {pair!r} must look like NAME=FILE.npy")
        if name in files and name not in repeated:
            repeated.append(name)
        files[name] = path
    if repeated:
        raise InputError(f"--input given more than once for {', '.join(map(repr, repeated))}; give each input once")
    return files


NPY_MAGIC = b"\x93NUMPY"


def _read_input_files(files: dict[str, str]) -> dict[str, np.ndarray]:
    """Each file as one array. Anything but an .npy is named as such: numpy takes other
    bytes for a pickle, and its advice (allow_pickle) would run code from the file."""
    out = {}
    for name, path in files.items():
        try:
            with open(path, "rb") as f:
                head = f.read(len(NPY_MAGIC))
            if head != NPY_MAGIC:
                raise ValueError("not an .npy file (one array written by numpy.save)")
            out[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise MeganeuraError(f"--input {name}: cannot read {path}: {reason}") from None
    return out


def write_npz(path, arrays: dict[str, np.ndarray]) -> None:
    """Write an .npz whole or not at all."""
    write_atomically(path, lambda f: np.savez(f, **arrays))


def _run_arguments(parser):
    _model_arguments(parser)
    parser.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                        help="an input tensor (default: the model's dataset)")
    parser.add_argument("--output", metavar="OUT.npz", help="write the outputs here")
    backend_argument(parser)


def backend_argument(parser) -> None:
    parser.add_argument("--backend", choices=("auto", "gpu", "reference"), default="auto",
                        help="auto (default): the GPU, or the reference executor where the adapter is a "
                             "software renderer; gpu forces the adapter")


def resolve_backend(args) -> str:
    """``--backend`` made concrete; a fallback from the GPU says so in one line."""
    from ..runtime.device import choose_backend
    backend, note = choose_backend(args.backend)
    if note:
        print(f"meganeura: note: {note}", file=sys.stderr, flush=True)
    return backend


def _run(args):
    model, params = load_model(args)
    inputs = model.example_inputs(train=False)
    files = _input_files(args.input)
    model.check_input_names(files)          # before reading: a misspelt name is named as such
    inputs.update(_read_input_files(files))
    args.backend = resolve_backend(args)
    progress(f"running {model.name} forward on the {args.backend} backend")
    start = time.perf_counter()
    outputs = model.run(inputs, params, backend=args.backend)
    seconds = time.perf_counter() - start
    if args.output:
        write_npz(args.output, outputs)
    summary = {name: {"shape": list(v.shape), "mean": float(np.mean(v)), "std": float(np.std(v))}
               for name, v in outputs.items()}
    if args.json:
        _print_json({"model": model.name, "backend": args.backend, "outputs": summary,
                     "seconds": seconds, "output_file": args.output})
    else:
        for name, s in summary.items():
            print(f"{name:<16}{str(s['shape']):<20} mean {s['mean']:+.5f}  std {s['std']:.5f}")
        print(f"{seconds:.3f} s" + (f", written to {args.output}" if args.output else ""))
    return 0


register_command("run", "one forward pass on given (or the dataset's) inputs", _run_arguments, _run,
                 outputs=("output",))


# ------------------------------------------------------------------ optimize

def _optimize_arguments(parser):
    _model_arguments(parser)
    parser.add_argument("--train", action="store_true",
                        help="optimize the training graph (forward and backward) instead of inference")
    parser.add_argument("--generate", choices=("prefill", "decode"),
                        help="optimize a generation graph of a causal LM instead: the prefill of a prompt of "
                             "seq tokens, or the one-token decode step over the KV cache")
    loss_arguments(parser)


def generation_graph(model, phase: str):
    """The prefill (of the model's ``seq`` tokens) or decode graph ``generate`` compiles."""
    from ..train.generation import cache_capacity
    seq = int(model.settings.get("seq", 1)) if phase == "prefill" else 1
    prompt = int(model.settings.get("seq", 1))
    return model.generation_graph(seq, cache_capacity(prompt + 1, model.context_length), phase == "prefill")


def _optimize(args):
    from ..autodiff.gradients import differentiate
    from ..optimize import optimize
    model = open_model(args)
    if args.weights:
        model.load_weights(args.weights)  # validates the file against the model
    if args.generate and args.train:
        raise MeganeuraError("--generate and --train optimize different graphs; give one of them")
    graph = generation_graph(model, args.generate) if args.generate else model.build(train=args.train)
    if args.train:
        graph, _ = optimize(graph)
        graph, _ = differentiate(graph)
    progress(f"optimizing {graph.name} ({len(graph)} nodes)")
    from ..optimize import cost
    from ..optimize.passes import INFERENCE, TRAINING, optimize_generation, run_passes
    if args.generate:
        fused, report, few = optimize_generation(graph)
        few = {"fusions": few, "dispatches_after": cost.graph_cost(fused)[1]}
        passes = None
    else:
        fused, report = optimize(graph)
        fused, applied = run_passes(fused, TRAINING if args.train else INFERENCE, report=report)
        passes = {"applied": applied, "dispatches_after": report.dispatches_after}
        few = None
    if args.json:
        d = report.to_dict()
        d["origins"] = {str(k): v for k, v in d["origins"].items()}
        _print_json({"model": model.name, "train": args.train, "generate": args.generate, **d, "few_rows": few,
                     "passes": passes})
    else:
        kind = f"generation {args.generate}" if args.generate else "training" if args.train else "inference"
        print(f"{model.name} ({kind} graph)")
        print(report.format_table())
        if few:
            applied = ", ".join(f"{k} x{v}" for k, v in few["fusions"].items()) or "none applied"
            print(f"then the few-row fusions (engine.optimize.few_rows): {applied}; "
                  f"{few['dispatches_after']} nodes that dispatch (the plan's dispatches: profile --generate)")
    return 0


register_command("optimize", "fuse a model's graph and print the fusion report", _optimize_arguments, _optimize)


# ------------------------------------------------------------------ train

def loss_arguments(parser) -> None:
    """--loss and --target: how an ONNX model, which declares no loss, trains."""
    parser.add_argument("--loss", choices=("mse", "cross-entropy"),
                        help="an ONNX model's loss, on the output named by --target")
    parser.add_argument("--target", metavar="OUTPUT", help="the ONNX output --loss compares with the targets")


CLIP_OFF = "off"


def clip_argument(text: str):
    """``--clip``'s value: a norm, or ``off`` to turn off a model's default clipping
    (its range is checked by TrainConfig, like every training option's)."""
    return CLIP_OFF if text.strip().lower() == CLIP_OFF else float(text)


def train_config(model, args):
    """The TrainConfig of the model's defaults and the options given; TrainConfig checks
    every value's range, so the CLI and the Studio refuse the same ones."""
    from ..train.config import TrainConfig
    fields = dict(model.TRAIN_DEFAULTS)
    chosen = {"optimizer": args.optimizer, "lr": args.lr, "schedule": args.schedule,
              "warmup_steps": args.warmup, "weight_decay": args.weight_decay, "momentum": args.momentum,
              "clip_norm": args.clip}
    fields.update({k: v for k, v in chosen.items() if v is not None})
    if fields.get("optimizer") == "sgd" and args.momentum is None:
        fields["momentum"] = 0.9
    if fields.get("clip_norm") == CLIP_OFF:
        fields["clip_norm"] = None
    return TrainConfig(**fields, steps=args.steps, batch_size=model.batch_size(), seed=args.seed)


def adapter_summary(backend: str) -> dict | None:
    """``engine.runtime.adapter_summary()`` of the adapter a gpu run uses (None for reference)."""
    if backend != "gpu":
        return None
    from ..runtime.device import adapter_summary as gpu_adapter_summary
    return gpu_adapter_summary()
