"""Per-module totals of a profile: the GPU time of each block of the model (its layers
and the modules beside them, ``engine.graph.modules``), for ``profile --group-by
module``, the ``modules`` list of ``profile --json`` and the Studio's kernel table.
Every dispatch counts in exactly one row, so the rows add up to the profile's total.
"""

from __future__ import annotations

from ..graph.modules import OPTIMIZER_STEP, TOP_LEVEL, block_of, containers


def module_rows(dispatches, steps: int) -> list[dict]:
    """One row per block, in the order the step first reaches it: ``name``, ``calls``,
    ``kernels`` (distinct kernel names), ``gpu_ns`` (all profiled steps),
    ``gpu_ns_per_step``, ``percent``, ``bytes``, ``flops``, ``gb_per_s``, ``tflop_per_s``."""
    opened = containers(d.module for d in dispatches if d.module != OPTIMIZER_STEP)
    groups: dict[str, list] = {}
    for d in dispatches:
        key = d.module if d.module == OPTIMIZER_STEP else block_of(d.module, opened)
        groups.setdefault(key or TOP_LEVEL, []).append(d)
    total = sum(d.gpu_ns for d in dispatches) or 1
    rows = []
    for name, ds in groups.items():
        t, b, f = (sum(getattr(d, k) for d in ds) for k in ("gpu_ns", "bytes", "flops"))
        rows.append({"name": name, "calls": len(ds), "kernels": len({d.kernel for d in ds}),
                     "gpu_ns": t, "gpu_ns_per_step": t / max(steps, 1), "percent": 100.0 * t / total,
                     "bytes": b, "flops": f, "gb_per_s": b / t if t else 0.0,
                     "tflop_per_s": f / t / 1e3 if t else 0.0})
    return rows


def format_module_table(rows: list[dict], fmt_ns) -> list[str]:
    """The rows as text lines (model order), like the per-kernel table."""
    name_w = min(max([len("Module")] + [len(r["name"]) for r in rows]), 60)
    head = (f"{'Module':<{name_w}}  {'GPU total %':>11}  {'GPU total':>10}  {'GPU/step':>10}  {'# Calls':>7}  "
            f"{'Kernels':>7}  {'GB/s':>8}  {'TFLOP/s':>8}")
    rule = "-" * len(head)
    lines = [rule, head, rule]
    for r in rows:
        name = r["name"] if len(r["name"]) <= name_w else "..." + r["name"][-(name_w - 3):]
        lines.append(f"{name:<{name_w}}  {r['percent']:>10.2f}%  {fmt_ns(r['gpu_ns']):>10}  "
                     f"{fmt_ns(r['gpu_ns_per_step']):>10}  {r['calls']:>7}  {r['kernels']:>7}  "
                     f"{r['gb_per_s']:>8.2f}  {r['tflop_per_s']:>8.4f}")
    lines.append(rule)
    return lines
