"""``meganeura inspect SOURCE``: what a model takes and gives, its size and its ops, read
from the file alone (no GPU)."""

from __future__ import annotations

from .commands import _print_json, open_model
from .registry import register_command


def _inspect_arguments(parser) -> None:
    parser.add_argument("model", metavar="SOURCE",
                        help="a built-in model name, an .onnx file or a Hugging Face checkpoint folder")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                        help="model setting or symbolic dimension, e.g. --set batch=1 (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def format_summary(s: dict) -> str:
    def tensors(title, items):
        rows = [f"{title}"] + [f"  {t['name']:<28} {str(t['shape']):<22} {t['dtype']}" for t in items]
        return "\n".join(rows)
    ops = sorted(s["ops"].items(), key=lambda kv: (-kv[1], kv[0]))
    lines = [f"model       {s['name']}" + (f" ({s['model_type']})" if s.get("model_type") else ""),
             tensors("inputs", s["inputs"]), tensors("outputs", s["outputs"]),
             f"parameters  {s['parameters']:,} ({s['parameter_bytes'] / 2**20:.1f} MiB as f32)",
             f"ops         {sum(s['ops'].values())} nodes, {len(ops)} kinds"]
    if s.get("context_length"):
        note = f" ({s['context_note']})" if s.get("context_note") else ""
        lines.insert(3, f"context     {s['context_length']:,} tokens{note}")
    lines += [f"  {name:<28} {count}" for name, count in ops]
    return "\n".join(lines)


def _inspect(args) -> int:
    summary = open_model(args).summary()
    if args.json:
        _print_json(summary)
    else:
        print(format_summary(summary))
    return 0


register_command("inspect", "a model's inputs, outputs, parameter count and op histogram", _inspect_arguments, _inspect)
