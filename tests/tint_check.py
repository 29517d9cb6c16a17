"""Tint's front end without a GPU, for the WGSL that CI's lavapipe cannot run (cooperative
matrices): a test's script runs in a fresh process on Dawn's Null backend (chosen before
wgpudawn loads, hence the process) with ``device`` (shader-f16, subgroups, subgroup
matrices) and ``check(label, kernel)``, which compiles each distinct kernel source once
and collects the failures."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

PRELUDE = """
import os, sys
os.environ["WGPU_BACKEND_TYPE"] = "Null"
import wgpudawn
from wgpudawn.backends.dawn import extras
from engine import codegen
extras.set_instance_extras(enable_toggles=["allow_unsafe_apis"])
device = wgpudawn.gpu.request_adapter_sync().request_device_sync(
    required_features=["shader-f16", "subgroups", codegen.SUBGROUP_MATRIX_FEATURE])
sources, failures = {}, []


def check(label, kernel):
    if kernel is not None and kernel.source not in sources:
        sources[kernel.source] = kernel.name
        try:
            device.create_shader_module(code=kernel.source)
        except Exception as exc:
            failures.append(f"{label} {kernel.name}: {str(exc)[:400]}")
"""

EPILOGUE = """
print(len(sources), sum("subgroupMatrixMultiplyAccumulate" in s for s in sources))
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


def tint_check(body: str) -> tuple[int, int]:
    """Runs ``body`` (which calls ``check``) after PRELUDE, with the repository and tests/
    importable; fails the test on any kernel Tint refuses. Returns (distinct kernel
    sources checked, how many of them use subgroup matrices)."""
    tests = Path(__file__).resolve().parent
    path = os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body) + EPILOGUE], cwd=tests.parent,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    kernels, coop = map(int, done.stdout.split("\n")[0].split())
    return kernels, coop
