"""``meganeura doctor``: the adapter wgpu chose, its features and limits, the kernel paths and package versions.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from .commands import _print_json
from .registry import register_command


# --- doctor --------------------------------------------------------------

DOCTOR_FEATURES = (
    "timestamp-query",
    "timestamp-query-inside-passes",
    "shader-f16",
    "subgroup",
    "cooperative-matrix",
)


def human_size(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            text = f"{value:.0f}" if abs(value - round(value)) < 0.005 else f"{value:.2f}"
            return f"{text} {unit}"
    return f"{n} B"


def _has_feature(wanted: str, present: list[str]) -> bool:
    """Loose match: wgpu-native has spelled subgroups and cooperative matrices
    several ways (subgroup, subgroups, cooperative-matrix, ...), and Dawn calls the
    latter chromium-experimental-subgroup-matrix."""
    names = [f.replace("_", "-").lower() for f in present]
    if wanted == "cooperative-matrix" and any("subgroup-matrix" in n for n in names):
        return True
    if wanted in ("subgroup", "cooperative-matrix"):
        return any(n.startswith(wanted[:-1]) for n in names)
    if wanted == "timestamp-query-inside-passes":
        return any(n.endswith(wanted) for n in names)
    return wanted in names


def kernel_paths() -> dict:
    """Which path each archetype's kernels take on this device: the capabilities of the
    features the device enabled (what sessions compile their plans for), and where the
    adapter offers cooperative matrices, whether and how the tensor cores are used."""
    from .. import codegen
    from ..runtime import device
    from ..runtime.device import device_capabilities

    caps = device_capabilities()
    paths = codegen.describe_paths(caps)
    if _has_feature("cooperative-matrix", [str(f) for f in device.get_adapter().features]):
        if device.backend() != "dawn":
            paths["cooperative_matrix"] = ("offered, not used: wgpu-native 29 cannot enable wgpu's experimental "
                                           "features (MEGANEURA_WGPU=dawn can)")
        elif caps.matmul_f16:
            paths["cooperative_matrix"] = "used: matmuls take f16 operands and accumulate in f32"
        elif caps.matmul_split:
            paths["cooperative_matrix"] = ("used: matmuls take each f32 operand as two f16 parts, three products "
                                           "accumulating in f32 (--precision f16: one product of f16 operands)")
        else:
            paths["cooperative_matrix"] = (f"offered, not used at precision {codegen.precision()}: "
                                           "--precision f16 (MEGANEURA_PRECISION=f16) uses them")
    return paths


def doctor_report() -> dict:
    from ..runtime import device

    info = device.adapter_info()
    return {
        "adapter": {
            "name": info["name"],
            "backend": info["backend"],
            "wgpu": info["wgpu"],
            "software": info["software"],
            "adapter_type": info["adapter_type"],
            "description": info["description"],
        },
        "features": info["features"],
        "all_features": info["all_features"],
        "limits": info["limits"],
        "paths": kernel_paths(),
        "tuning": asdict(device.device_capabilities().tuning),
        "versions": device.versions(),
    }


def format_doctor(report: dict) -> str:
    a = report["adapter"]
    kind = "software renderer: correct but slow" if a["software"] else "hardware"
    lines = [
        f"Adapter   {a['name']}",
        f"Backend   {a['backend']} (through {'Dawn' if a.get('wgpu') == 'dawn' else 'wgpu-native'})",
        f"Type      {a['adapter_type']} ({kind})",
    ]
    if a.get("description"):
        lines.append(f"Driver    {a['description']}")
    lines += ["", "Features"]
    for f in DOCTOR_FEATURES:
        lines.append(f"  {f:<32}{'yes' if _has_feature(f, report['all_features']) else 'no'}")
    lines += ["", "Limits"]
    for name, value in report["limits"].items():
        shown = human_size(value) if name.endswith(("_size",)) else ("n/a" if value is None else str(value))
        lines.append(f"  {name:<40}{shown}")
    lines += ["", "Kernel paths"]
    for name, path in report["paths"].items():
        lines.append(f"  {name:<20}{path}")
    tuning = report["tuning"]
    lines += ["", f"Tuning ({'meganeura tune' if tuning['source'] == 'tuned' else 'defaults: run meganeura tune'})"]
    lines += [f"  {name:<20}{value}" for name, value in tuning.items() if name != "source"]
    lines += ["", "Versions"]
    for name, value in report["versions"].items():
        lines.append(f"  {name:<18}{value if value is not None else 'not installed'}")
    if not _has_feature("timestamp-query", report["all_features"]):
        lines += ["", "Note: no timestamp-query; profiles will use CPU wall time per submission."]
    return "\n".join(lines)


def _doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _doctor(args: argparse.Namespace) -> int:
    report = doctor_report()
    if args.json:
        _print_json(report)
    else:
        print(format_doctor(report))
    return 0


register_command(
    "doctor",
    "show the GPU adapter wgpu chose, its features and limits, and package versions",
    _doctor_arguments,
    _doctor,
)
