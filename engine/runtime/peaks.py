"""The adapter's roofs: peak f32 FLOP/s, f16 FLOP/s where matmuls run on cooperative
matrices, and memory bandwidth; measured once per adapter and cached.

Measured by small kernels timed with GPU timestamps (CPU wall time per submission
where the adapter lacks timestamp-query), the best of a few repeats each:

- f32: ``shaders/peak_fma.wgsl``, threads each running a loop of independent vec4
  FMAs held in registers (128 FLOPs a round);
- f16: our cooperative-matrix matmul (the kernel ``MEGANEURA_PRECISION=f16`` takes)
  on square matrices: what our best kernel reaches, a lower bound on the hardware's;
  null where the adapter has no cooperative matrices for us (wgpu-native, lavapipe);
- bandwidth: ``shaders/peak_copy.wgsl``, a grid-stride vec4 copy (2 x its size moved).

Sizes follow the adapter: a software one (lavapipe) gets tiny work, so measuring takes
well under a second there. The result is a JSON file in the user cache folder (beside
the plan cache: ``MEGANEURA_CACHE`` or platformdirs'), one per ``peaks_key()``:
adapter name, driver, backend, wgpu implementation and engine version
(engine/runtime/adapter_cache.py, which ``meganeura tune``'s results share).
"""

from __future__ import annotations

import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from ..compile.plan import compile_plan
from ..errors import MeganeuraError, MeganeuraWarning
from ..graph.ir import Graph
from ..paths import shader_dir
from .adapter_cache import adapter_key, key_file_name, measurements_dir, read_measurement, write_measurement  # noqa: F401
from .device import adapter_info, get_device, offered_capabilities, shader_module, wgpu_module
from .profiler import DispatchTimestamps, timestamp_period, timestamp_support
from .session import Session

PEAKS_FORMAT = 1
REPEATS = 4
FMA_FLOPS_PER_ROUND = 128   # 16 vec4 FMAs a round (shaders/peak_fma.wgsl)
WORKGROUP = 256

# Work per measurement: (FMA workgroups, FMA rounds, copy bytes, f16 matmul size)
HARDWARE_SIZES = {"fma_workgroups": 4096, "fma_rounds": 1024, "copy_bytes": 256 << 20, "matmul": 4096}
SOFTWARE_SIZES = {"fma_workgroups": 32, "fma_rounds": 64, "copy_bytes": 4 << 20, "matmul": 256}


# ---------------------------------------------------------------- the cache

def peaks_key(info: dict | None = None) -> dict:
    """What a measurement is valid for: the adapter's name, its driver, the graphics
    backend, the wgpu implementation and the engine version (``info``: an
    ``adapter_info()``, default the process's adapter)."""
    return adapter_key(info if info is not None else adapter_info(), PEAKS_FORMAT)


def peaks_dir(cache_dir=None) -> Path:
    """The folder of the measurements: ``cache_dir``, else ``peaks`` beside the plan cache."""
    return measurements_dir("peaks", cache_dir)


def read_peaks(key: dict, cache_dir=None) -> dict | None:
    """The cached measurement for ``key``, or None (missing, unreadable or another key's)."""
    return read_measurement("peaks", key, cache_dir, _valid)


def _valid(peaks) -> bool:
    def positive(v):
        return isinstance(v, (int, float)) and np.isfinite(v) and v > 0
    return (isinstance(peaks, dict) and positive(peaks.get("flop_per_s_f32")) and positive(peaks.get("bytes_per_s"))
            and (peaks.get("flop_per_s_f16") is None or positive(peaks["flop_per_s_f16"])))


def write_peaks(key: dict, peaks: dict, cache_dir=None) -> Path:
    """Store ``peaks`` under ``key`` (written to a temp file and renamed)."""
    return write_measurement("peaks", key, peaks, cache_dir)


def adapter_peaks(device=None, cache_dir=None, refresh: bool = False, progress=None) -> dict:
    """The process adapter's roofs: from the cache, else measured now and cached
    (``refresh`` measures again). A cache that cannot be written is warned about."""
    key = peaks_key()
    if not refresh:
        cached = read_peaks(key, cache_dir)
        if cached is not None:
            return {**cached, "cached": True}
    if progress:
        progress(f"measuring the roofs of {key['adapter']} (once per adapter; cached in {peaks_dir(cache_dir)})")
    peaks = measure_peaks(device)
    try:
        write_peaks(key, peaks, cache_dir)
    except (OSError, MeganeuraError) as e:
        warnings.warn(f"could not cache the adapter's peaks in {peaks_dir(cache_dir)}: {e}", MeganeuraWarning)
    return {**peaks, "cached": False}


# ---------------------------------------------------------------- measuring

def measure_peaks(device=None, software: bool | None = None) -> dict:
    """Measure the roofs now (nothing cached): ``flop_per_s_f32``, ``flop_per_s_f16``
    (or None), ``bytes_per_s``, how they were timed, the sizes used, when and how long."""
    device = device if device is not None else get_device()
    software = adapter_info()["software"] if software is None else software
    sizes = dict(SOFTWARE_SIZES if software else HARDWARE_SIZES)
    limit = int(device.limits.get("max-storage-buffer-binding-size", 1 << 27))
    sizes["copy_bytes"] = min(sizes["copy_bytes"], limit // 2 // 16 * 16)
    start = time.perf_counter()
    f32 = _measure_fma(device, sizes["fma_workgroups"], sizes["fma_rounds"])
    bandwidth = _measure_copy(device, sizes["copy_bytes"])
    f16 = _measure_coop_matmul(device, sizes["matmul"])
    return {"flop_per_s_f32": f32, "flop_per_s_f16": f16, "bytes_per_s": bandwidth,
            "timing": "gpu timestamps" if timestamp_support(device) else "cpu wall time per submission",
            "sizes": sizes, "seconds": time.perf_counter() - start,
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _pipeline(device, name: str):
    module = shader_module(device, name, (shader_dir() / f"{name}.wgsl").read_text(), "unchecked")
    return device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})


def _bind(device, pipeline, buffers: list) -> object:
    return device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=[
        {"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}} for i, b in enumerate(buffers)])


def _best_ns(device, steps: list[tuple], wait_buffer, repeats: int = REPEATS) -> float:
    """The fastest of ``repeats`` runs of ``steps`` ((pipeline, bind group, workgroups)
    each, a pass each), in ns: GPU timestamps, else CPU wall time per submission."""
    if not timestamp_support(device):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            enc = device.create_command_encoder(label="peaks")
            Session._record_steps(enc, "peaks", steps, range(len(steps)))
            device.queue.submit([enc.finish()])
            device.queue.read_buffer(wait_buffer, 0, 4)
            best = min(best, time.perf_counter_ns() - t0)
        return float(best)
    runs = steps * repeats
    stamps = DispatchTimestamps(device, len(runs), inside_passes=False)
    enc = device.create_command_encoder(label="peaks")
    Session._record_steps(enc, "peaks", runs, range(len(runs)), stamps)
    stamps.resolve(enc)
    device.queue.submit([enc.finish()])
    ticks = stamps.read() * timestamp_period(device)
    n = len(steps)
    return float(min(ticks[2 * (r * n + n - 1) + 1] - ticks[2 * r * n] for r in range(repeats)))


def _buffer(device, nbytes: int, usage):
    wgpu = wgpu_module()
    return device.create_buffer(size=nbytes, usage=usage | wgpu.BufferUsage.COPY_SRC)


def _measure_fma(device, workgroups: int, rounds: int) -> float:
    wgpu = wgpu_module()
    pipeline = _pipeline(device, "peak_fma")
    params = device.create_buffer_with_data(data=np.array([rounds, 0, 0, 0], dtype=np.uint32).tobytes(),
                                            usage=wgpu.BufferUsage.UNIFORM)
    sink = _buffer(device, workgroups * WORKGROUP * 16, wgpu.BufferUsage.STORAGE)
    ns = _best_ns(device, [(pipeline, _bind(device, pipeline, [params, sink]), (workgroups, 1, 1))], sink)
    return workgroups * WORKGROUP * rounds * FMA_FLOPS_PER_ROUND / ns * 1e9


def _measure_copy(device, nbytes: int) -> float:
    wgpu = wgpu_module()
    pipeline = _pipeline(device, "peak_copy")
    src = _buffer(device, nbytes, wgpu.BufferUsage.STORAGE)
    dst = _buffer(device, nbytes, wgpu.BufferUsage.STORAGE)
    workgroups = max(1, min(8192, nbytes // 16 // WORKGROUP // 8))   # about 8 rounds a thread
    ns = _best_ns(device, [(pipeline, _bind(device, pipeline, [src, dst]), (workgroups, 1, 1))], dst)
    return 2 * nbytes / ns * 1e9


def _measure_coop_matmul(device, n: int) -> float | None:
    """Our cooperative-matrix matmul at n x n x n, or None where matmuls cannot take it
    (whatever precision the process asked for: ``offered_capabilities``)."""
    caps = offered_capabilities(device)
    if not caps.matmul_f16:
        return None
    g = Graph("peak-matmul")
    g.output("c", g.matmul(g.input("a", (n, n)), g.input("b", (n, n))))
    session = Session(g, compile_plan(g, loss=None, capabilities=caps), device)
    out = session.buffers[session.plan.outputs["c"]]
    return 2.0 * n ** 3 / _best_ns(device, list(session._steps), out) * 1e9
