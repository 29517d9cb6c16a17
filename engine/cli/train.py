"""``meganeura train``: train a model on its own dataset or the user's (``--data``),
writing a run directory (``--run-dir``, default ``runs/MODEL-TIMESTAMP``: config.json,
metrics.jsonl, status.json, checkpoints); ``--resume DIR`` goes on from DIR's latest
checkpoint. ``--json`` prints one object on stdout; docs/cli.md documents the fields.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..errors import MeganeuraError
from .commands import (_model_arguments, _print_json, adapter_summary, backend_argument, clip_argument, load_model,
                       loss_arguments, progress, resolve_backend, train_config)
from .registry import register_command

DEFAULT_STEPS = 50
# What a run's config.json fixes: given with --resume, they are ignored (and said so).
RUN_OPTIONS = ("model", "settings", "weights", "optimizer", "lr", "schedule", "warmup", "weight_decay", "momentum",
               "clip", "data", "val_data", "val_fraction", "run_dir", "loss", "target")


def _train_arguments(parser):
    _model_arguments(parser, required=False)
    parser.add_argument("--steps", type=int, help=f"training steps in all (default {DEFAULT_STEPS}; with --resume "
                                                  f"the run's own)")
    parser.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), help="default: the model's")
    parser.add_argument("--lr", type=float, help="peak learning rate (default: the model's)")
    parser.add_argument("--schedule", choices=("constant", "warmup", "cosine"), help="learning-rate schedule")
    parser.add_argument("--warmup", type=int, help="linear warm-up steps")
    parser.add_argument("--weight-decay", type=float, help="weight decay (decoupled for adamw)")
    parser.add_argument("--momentum", type=float, help="SGD momentum (default 0.9 with --optimizer sgd)")
    parser.add_argument("--clip", type=clip_argument, metavar="NORM|off",
                        help="clip gradients to this global norm (> 0); off: no clipping (default: the model's)")
    parser.add_argument("--data", metavar="PATH",
                        help="training data: an .npz (or a folder of .npy) named after the model's inputs, text "
                             "(.txt/.jsonl or a folder of them) for causal LMs, audio (a folder of .wav/.flac) for "
                             "whisper-tiny and audio-align (default: the model's synthetic dataset)")
    parser.add_argument("--val-data", metavar="PATH", help="validation data, in any form --data takes")
    parser.add_argument("--val-fraction", type=float, metavar="F",
                        help="hold out this fraction of the examples for validation (default 0.05 with --data "
                             "and no --val-data, else 0)")
    parser.add_argument("--eval-every", type=int, default=50, metavar="N",
                        help="validation loss every N steps and at the last (default 50; 0: at the last only)")
    parser.add_argument("--save-every", type=int, default=500, metavar="N",
                        help="a checkpoint every N steps (default 500; 0: at the end only)")
    parser.add_argument("--run-dir", metavar="DIR",
                        help="the run directory (default runs/MODEL-TIMESTAMP, or under $MEGANEURA_RUNS)")
    parser.add_argument("--resume", metavar="DIR",
                        help="go on from DIR's latest checkpoint up to --steps in all, with the run's own options")
    parser.add_argument("--save", metavar="FILE", help="also write the trained weights (.safetensors) here")
    parser.add_argument("--loss-csv", metavar="FILE", help="write this invocation's loss history as CSV")
    backend_argument(parser)
    loss_arguments(parser)


def absolute(path: str | None) -> str | None:
    """A path as an absolute one (so that a run resumes from any folder)."""
    return os.path.abspath(path) if path else None


def _train(args) -> int:
    from ..train.run import RunOptions, TrainingRun
    from ..train.run_dir import discard_if_empty, new_run_path
    if args.resume:
        return _resume(args)
    if args.model is None:
        raise MeganeuraError("give the SOURCE to train (a built-in name, an .onnx file or a checkpoint folder), "
                             "or --resume DIR")
    args.steps = DEFAULT_STEPS if args.steps is None else args.steps
    model, params = load_model(args)
    config = train_config(model, args)
    args.backend = resolve_backend(args)
    from ..importers import source_kind
    import_options = {k: getattr(args, k) for k in ("loss", "target") if getattr(args, k, None)}
    options = RunOptions(source=args.model if source_kind(args.model) == "builtin" else absolute(args.model),
                         settings=dict(model.settings), weights=absolute(args.weights), data=absolute(args.data),
                         val_data=absolute(args.val_data), val_fraction=args.val_fraction,
                         eval_every=args.eval_every, save_every=args.save_every, backend=args.backend,
                         import_options=import_options)
    path = Path(args.run_dir) if args.run_dir else new_run_path(model.name)
    building = f"building the {args.backend} training session for {model.name} (run directory {path})"
    try:
        return _go(args, model, building,
                   lambda **hooks: TrainingRun.start(model, params, config, options, path, **hooks))
    finally:
        if not args.run_dir:   # the default folder new_run_path made, if the run never wrote to it
            discard_if_empty(path)


def _flag(option: str) -> str:
    """How the user wrote ``option`` on the command line."""
    return {"model": "SOURCE", "settings": "--set"}.get(option, "--" + option.replace("_", "-"))


def _resume(args) -> int:
    from ..importers import load_run_model
    from ..train.run import TrainingRun
    from ..train.run_dir import RunDirectory
    directory = RunDirectory.open(args.resume)
    ignored = [_flag(name) for name in RUN_OPTIONS if getattr(args, name, None) not in (None, [])]
    if ignored:
        print(f"meganeura: note: --resume goes on with the run's own options (its config.json); ignoring "
              f"{', '.join(ignored)}", file=sys.stderr, flush=True)
    model = load_run_model(directory.config())
    backend = resolve_backend(args) if args.backend != "auto" else None
    return _go(args, model, f"resuming {directory.path} ({model.name})",
               lambda **hooks: TrainingRun.resume(directory, model, args.steps, backend, **hooks))


def _go(args, model, building: str, make_run) -> int:
    """Build the run (saying ``building`` once its data is read) with a progress bar on
    its steps, run it, report it."""
    from tqdm import tqdm
    bar = tqdm(desc=f"train {model.name}", unit="step", file=sys.stderr, disable=None if not args.json else True)

    def show(row):
        bar.update(1)
        bar.set_postfix({k: f"{row[k]:.4f}" for k in ("loss", "val_loss") if k in row})

    def prepared(data):
        for note in data.notes:
            print(f"meganeura: note: {note}", file=sys.stderr, flush=True)
        progress(building)

    try:
        run = make_run(on_step=show, prepared=prepared)
        bar.reset(total=run.total_steps)
        bar.update(run.first_step)
        start = time.perf_counter()
        status = run.run()
    finally:
        bar.close()
    return _report(args, model, run, status, time.perf_counter() - start)


def _report(args, model, run, status: str, seconds: float) -> int:
    history = run.trainer.history
    if args.save:
        model.save_weights(run.trainer.params, args.save)
    if args.loss_csv:
        history.to_csv(args.loss_csv)
    losses = list(history.losses)
    backend = run.options.backend
    session = run.trainer.session
    if args.json:
        _print_json({"model": model.name, "backend": backend, "adapter": adapter_summary(backend),
                     "steps": len(losses), "losses": losses, "seconds": seconds,
                     "build_seconds": session.build_seconds if session is not None else None,
                     "stopped": status == "stopped",
                     "saved": args.save, "run_dir": str(run.directory.path), "status": status,
                     "first_step": run.first_step, "last_step": run.trainer.step_count,
                     "checkpoint": str(run.checkpoint) if run.checkpoint else None})
    elif losses:
        print(f"{model.name}: steps {run.first_step + 1}-{run.trainer.step_count} on {backend}, loss "
              f"{losses[0]:.4f} -> {losses[-1]:.4f} in {seconds:.1f} s; run directory {run.directory.path}"
              + (f"; weights saved to {args.save}" if args.save else ""))
    else:
        print(f"{model.name}: nothing to do, the run is at step {run.trainer.step_count} of {run.total_steps}; "
              f"raise --steps to go on")
    if status == "stopped":
        print(f"interrupted after step {run.trainer.step_count}; go on with: meganeura train --resume "
              f"{run.directory.path}", file=sys.stderr)
        return 130
    return 0


register_command("train", "train a model, writing a run directory; --resume one", _train_arguments, _train,
                 outputs=("save", "loss_csv"))
