"""``meganeura tune``: measure how many workgroups fill this adapter for each kernel
family and cache the winners, which every later plan on the adapter reads.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from .commands import _print_json, loss_arguments, open_model, progress
from .registry import register_command
from ..errors import MeganeuraError


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="SOURCE", nargs="?",
                        help="also time the products of this model's training step (a built-in model name, an "
                             ".onnx file or a Hugging Face checkpoint folder): no tuned value may make it slower")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                        help="setting of SOURCE, e.g. --set batch=8 (repeatable)")
    parser.add_argument("--inference", action="store_true", help="time SOURCE's inference graph, not its training")
    loss_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--show", action="store_true", help="print the tuning plans use now; measure nothing")
    what.add_argument("--reset", action="store_true", help="forget this adapter's tuning (plans take the defaults)")


def _adapter() -> tuple[dict, dict]:
    """(the adapter as reports show it, its whole ``adapter_info()``)."""
    from ..runtime.device import adapter_info
    info = adapter_info()
    return {k: info[k] for k in ("name", "backend", "wgpu", "software")}, info


def current_tuning() -> dict:
    """What plans on this adapter use now: the cached tuning run, or the defaults."""
    from ..codegen import Tuning
    from ..runtime.tuning import read_tuning, tuning_key
    from ..runtime.adapter_cache import measurement_path
    adapter, info = _adapter()
    key = tuning_key(info)
    stored = read_tuning(key)
    path = measurement_path("tuning", key)
    base = stored if stored is not None else {"tuning": asdict(Tuning()), "defaults": asdict(Tuning())}
    return {**base, "adapter": adapter, "key": key, "path": str(path), "cached": stored is not None}


def format_tuning(report: dict) -> str:
    lines = [f"Adapter  {report['adapter']['name']} ({report['adapter']['backend']}, {report['adapter']['wgpu']})"]
    if report.get("measurements"):
        lines.append(f"Timed    {report.get('timing', '?')}, {report.get('seconds', 0):.1f} s, "
                     f"{report.get('measured_at', '')}")
    if report.get("models"):
        lines.append(f"Models   {', '.join(report['models'])} (none of their products may get slower)")
    lines.append("")
    measurements = report.get("measurements", {})
    for field, default in report["defaults"].items():
        if field == "source":
            continue
        value = report["tuning"][field]
        lines.append(f"{field:<18}{value:>6}   (default {default})")
        for row in measurements.get(field, []):
            mark = "  <- chosen" if row["value"] == value else ""
            lines.append(f"    {row['value']:>6}  {row['ms']:9.3f} ms{mark}")
    lines += ["", f"Source   {report['tuning']['source']}: "
              + (f"cached in {report['path']}" if report.get("cached", True) else "the defaults (nothing cached)")]
    return "\n".join(lines)


def _model_products(args: argparse.Namespace) -> list:
    """The products of SOURCE's training step (or inference graph), grouped under its name and settings."""
    from ..runtime.tuner import model_products
    model = open_model(args)
    group = " ".join([model.name, *args.settings])
    products = model_products(model, group, train=not args.inference)
    progress(f"{group}: {len(products)} distinct products join the matmul fields' workloads")
    return products


def _tune(args: argparse.Namespace) -> int:
    from ..runtime.tuner import tune
    if args.inference and not args.model:
        raise MeganeuraError("--inference says which graph of SOURCE to time; give SOURCE too")
    if args.model and (args.reset or args.show):
        raise MeganeuraError(f"--{'reset' if args.reset else 'show'} measures nothing: "
                             f"SOURCE ({args.model}) only joins a tuning run")
    if args.reset:
        Path(current_tuning()["path"]).unlink(missing_ok=True)
        report = current_tuning()
        progress(f"forgot the tuning of {report['adapter']['name']}; plans take the defaults")
    elif args.show:
        report = current_tuning()
    else:
        adapter, _ = _adapter()
        products = _model_products(args) if args.model else []
        progress(f"tuning {adapter['name']}: timing kernels at several workgroup counts")
        report = {**tune(progress=progress, products=products), "adapter": adapter, "cached": True}
    if args.json:
        _print_json(report)
    else:
        print(format_tuning(report))
    return 0


register_command("tune", "measure how many workgroups fill this GPU per kernel family; cache the winners",
                 _arguments, _tune)
