"""Two profiles side by side: ``meganeura compare A.json B.json`` and the Studio's
Compare view share ``compare_profiles``.

A profile is what ``meganeura profile --json`` prints (``ProfileReport.to_dict()``).
Kernels are matched by name; a name's time is the sum of its ``per_kernel`` rows (a
name can repeat) divided by the profile's steps, so profiles of different step counts
compare per step. ``ratio`` is B over A: below 1, B is faster.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import MeganeuraError
from .report import short_kernel


class ProfileFileError(MeganeuraError):
    """A file given as a profile is missing, not JSON, or not a ``profile --json`` output."""


def load_profile(path) -> dict:
    """A ``profile --json`` output read from ``path``, checked to be one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileFileError(f"{path}: no such file; give a file written by meganeura profile --json") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileFileError(f"{path}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise ProfileFileError(f"{path}: not JSON ({e.msg} at line {e.lineno}); "
                               f"give a file written by meganeura profile --json") from None
    check_profile(data, str(path))
    return data


def check_profile(data, where: str = "profile") -> None:
    """Raise ``ProfileFileError`` unless ``data`` looks like a ``profile --json`` output."""
    if not isinstance(data, dict) or not isinstance(data.get("per_kernel"), list) \
            or not isinstance(data.get("steps"), int) or data["steps"] < 1:
        raise ProfileFileError(f"{where}: not a profile (no per_kernel rows or steps); "
                               f"give a file written by meganeura profile --json")
    for row in data["per_kernel"]:
        if not isinstance(row, dict) or not isinstance(row.get("name"), str) \
                or not isinstance(row.get("gpu_ns"), (int, float)):
            raise ProfileFileError(f"{where}: a per_kernel row lacks its name or gpu_ns: {str(row)[:80]}")


def kernel_times(profile: dict) -> dict[str, dict]:
    """Kernel name -> ``ns`` (GPU time per step) and ``calls`` (per step), in the
    profile's order (slowest first)."""
    steps = profile["steps"]
    out: dict[str, dict] = {}
    for row in profile["per_kernel"]:
        k = out.setdefault(row["name"], {"ns": 0.0, "calls": 0.0})
        k["ns"] += row["gpu_ns"] / steps
        k["calls"] += row.get("calls", 0) / steps
    return out


def _side(profile: dict, source: str | None) -> dict:
    adapter = profile.get("adapter") or {}
    return {"source": source, "model": profile.get("model"), "adapter": adapter.get("name"),
            "precision": adapter.get("matmul_precision"), "steps": profile["steps"],
            "train": profile.get("train"), "mode": profile.get("mode")}


def _notes(a: dict, b: dict) -> list[str]:
    """What differs between the two runs besides the kernels (a reader should know)."""
    notes = []
    for key, what in (("model", "models"), ("train", "step kinds (training / inference)"),
                      ("adapter", "adapters"), ("precision", "matmul precisions"), ("mode", "timing modes")):
        if a.get(key) != b.get(key):
            notes.append(f"different {what}: {a.get(key)} vs {b.get(key)}")
    return notes


def compare_profiles(a: dict, b: dict, a_source: str | None = None, b_source: str | None = None) -> dict:
    """Per kernel name: ``a_ns``, ``b_ns`` (GPU ns per step), ``delta_ns`` (b - a),
    ``ratio`` (b / a); totals over every kernel; the names in only one profile."""
    check_profile(a, a_source or "A")
    check_profile(b, b_source or "B")
    ka, kb = kernel_times(a), kernel_times(b)
    rows = []
    for name in ka.keys() & kb.keys():
        x, y = ka[name]["ns"], kb[name]["ns"]
        rows.append({"name": name, "a_ns": x, "b_ns": y, "delta_ns": y - x, "ratio": y / x if x else None,
                     "a_calls": ka[name]["calls"], "b_calls": kb[name]["calls"]})
    rows.sort(key=lambda r: (-abs(r["delta_ns"]), r["name"]))
    only_a = [{"name": n, "a_ns": ka[n]["ns"]} for n in ka if n not in kb]
    only_b = [{"name": n, "b_ns": kb[n]["ns"]} for n in kb if n not in ka]
    a_total, b_total = sum(k["ns"] for k in ka.values()), sum(k["ns"] for k in kb.values())
    side_a, side_b = _side(a, a_source), _side(b, b_source)
    return {"a": side_a, "b": side_b, "rows": rows,
            "a_total_ns": a_total, "b_total_ns": b_total, "delta_total_ns": b_total - a_total,
            "ratio_total": b_total / a_total if a_total else None,
            "matched_a_ns": sum(r["a_ns"] for r in rows), "matched_b_ns": sum(r["b_ns"] for r in rows),
            "only_a": only_a, "only_b": only_b, "notes": _notes(side_a, side_b)}


def _us(ns: float) -> str:
    return f"{ns / 1e3:,.1f}"


def format_comparison(c: dict, top: int = 30) -> str:
    """The comparison as a text table, biggest change first."""
    rows = [dict(r, name=short_kernel(r["name"])) for r in c["rows"][:top]]
    width = min(60, max([len("Kernel")] + [len(r["name"]) for r in rows]))
    head = f"{'Kernel':<{width}}  {'A µs/step':>11}  {'B µs/step':>11}  {'Δ µs':>10}  {'B/A':>6}"
    lines = [f"A: {c['a']['source'] or 'A'} ({c['a']['model']}, {c['a']['adapter']})",
             f"B: {c['b']['source'] or 'B'} ({c['b']['model']}, {c['b']['adapter']})", "", head, "-" * len(head)]
    for r in rows:
        name = r["name"] if len(r["name"]) <= width else r["name"][:width - 3] + "..."
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        lines.append(f"{name:<{width}}  {_us(r['a_ns']):>11}  {_us(r['b_ns']):>11}  "
                     f"{_us(r['delta_ns']):>10}  {ratio:>6}")
    if len(c["rows"]) > top:
        lines.append(f"({len(c['rows']) - top} more matched kernels not shown)")
    lines.append("-" * len(head))
    ratio = f"{c['ratio_total']:.2f}" if c["ratio_total"] is not None else "-"
    lines.append(f"{'Total (all kernels)':<{width}}  {_us(c['a_total_ns']):>11}  {_us(c['b_total_ns']):>11}  "
                 f"{_us(c['delta_total_ns']):>10}  {ratio:>6}")
    for side, key in (("A", "only_a"), ("B", "only_b")):
        if c[key]:
            ns_key = "a_ns" if side == "A" else "b_ns"
            names = ", ".join(f"{k['name']} ({_us(k[ns_key])} µs)" for k in c[key][:10])
            more = f" and {len(c[key]) - 10} more" if len(c[key]) > 10 else ""
            lines.append(f"Only in {side}: {names}{more}")
    lines += [f"Note: {n}" for n in c["notes"]]
    return "\n".join(lines)
