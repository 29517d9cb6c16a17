"""Which roof bounds a kernel: compute, memory or latency, and how close it runs to it.

Pure arithmetic on a ``per_kernel`` row (FLOPs, bytes, GPU time, calls) and the
adapter's peaks (``engine.runtime.peaks``: ``flop_per_s_f32``, ``flop_per_s_f16`` or
null, ``bytes_per_s``). Per call, with ``t`` the kernel's average duration:

- ``t_compute = flops / peak_flop_per_s`` and ``t_memory = bytes / peak_bytes_per_s``
  are the times it would take at each roof; ``t_roof = max(t_compute, t_memory)`` is
  the fastest it could run (the roofline model).
- **latency** when ``t < SHORT_NS`` (a dispatch this short is dominated by launch and
  ramp-up on any GPU), or when ``t_roof < SMALL_NS`` and ``t_roof < FAR_BELOW * t``:
  the work is too small to fill the device, so the kernel's time is mostly fixed cost,
  not either roof.
- otherwise **compute** when ``t_compute >= t_memory``, else **memory**.

``percent_of_peak``: for compute, achieved FLOP/s over the compute peak; for memory,
achieved bytes/s over the bandwidth; for latency, ``t_roof / t`` (how much of the
attainable speed it reaches), all in percent. The compute peak is the f16 one for
matmul, convolution and attention kernels of a profile whose matmuls ran in f16
(cooperative matrices; attention's forward and backward take them too), a third of it
for matmul and convolution kernels of one whose matmuls ran in f32x3 (three f16
products a product; its attention runs in f32), the f32 one otherwise: against the f32
roof the cooperative attention kernels read as 85-98% of peak on the H100 where they
run at 35-40% of the f16 one, and the split products as 100-140%.
"""

from __future__ import annotations

SHORT_NS = 2_000      # shorter dispatches are launch-bound on any GPU
SMALL_NS = 10_000     # work that takes less than this at the roofs cannot fill the device...
FAR_BELOW = 0.25      # ...when the kernel takes four times longer than that or more
COOP_ARCHETYPES = ("matmul", "conv", "attention")
SPLIT_ARCHETYPES = ("matmul", "conv")

BOUNDS = ("compute", "memory", "latency")


def compute_peak(peaks: dict, archetype: str, precision: str = "f32") -> float:
    """The FLOP/s roof of a kernel of ``archetype`` in a profile whose matmuls ran in ``precision``."""
    if precision == "f16" and archetype in COOP_ARCHETYPES and peaks.get("flop_per_s_f16"):
        return float(peaks["flop_per_s_f16"])
    if precision == "f32x3" and archetype in SPLIT_ARCHETYPES and peaks.get("flop_per_s_f16"):
        return float(peaks["flop_per_s_f16"]) / 3
    return float(peaks["flop_per_s_f32"])


def classify(flops: float, nbytes: float, ns_per_call: float, peak_flop_per_s: float,
             peak_bytes_per_s: float) -> tuple[str, float]:
    """(bound, percent_of_peak) of a kernel call doing ``flops`` and moving ``nbytes``
    in ``ns_per_call`` nanoseconds, under the two roofs (the rule is the module's)."""
    t_compute = 1e9 * flops / peak_flop_per_s if peak_flop_per_s > 0 else 0.0
    t_memory = 1e9 * nbytes / peak_bytes_per_s if peak_bytes_per_s > 0 else 0.0
    t_roof = max(t_compute, t_memory)
    if ns_per_call <= 0:
        return "latency", 0.0
    if ns_per_call < SHORT_NS or (t_roof < SMALL_NS and t_roof < FAR_BELOW * ns_per_call):
        return "latency", 100.0 * t_roof / ns_per_call
    if t_compute >= t_memory:
        return "compute", 100.0 * t_compute / ns_per_call
    return "memory", 100.0 * t_memory / ns_per_call


def kernel_roofline(row: dict, peaks: dict | None, precision: str = "f32") -> dict:
    """``bound``, ``percent_of_peak`` and ``intensity`` (FLOP per byte) of a
    ``per_kernel`` row; bound and percent are None without peaks."""
    intensity = row["flops"] / row["bytes"] if row["bytes"] else None
    if not peaks or not row["calls"]:
        return {"bound": None, "percent_of_peak": None, "intensity": intensity}
    calls = row["calls"]
    bound, percent = classify(row["flops"] / calls, row["bytes"] / calls, row["gpu_ns"] / calls,
                              compute_peak(peaks, row["archetype"], precision), float(peaks["bytes_per_s"]))
    return {"bound": bound, "percent_of_peak": percent, "intensity": intensity}
