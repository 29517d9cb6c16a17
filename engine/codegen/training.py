"""Kernels of a training step that are not graph nodes: the gradient-norm partial sums
and total, the optimizer update and gradient copies (``engine.train.session``).
"""

from __future__ import annotations

from .common import Kernel, WG, _finish, f32_bits, grid_1d


# ---------------------------------------------------------------- training-step kernels
# Not graph nodes: the optimizer update and the gradient-norm partial sums that a GPU
# training step appends after the backward pass (engine/training_session.py).

OPTIMIZER_KINDS = {"sgd": 0, "adam": 1, "adamw": 2}


NORM_CHUNK = 4096  # gradient elements per workgroup of the norm partial sums


def norm_partials(n: int) -> int:
    """How many partials (each two stats slots: scale, scaled sum of squares) a gradient
    of n elements writes."""
    return max(1, -(-n // NORM_CHUNK))


def sum_squares_kernel(n: int, first_slot: int) -> Kernel:
    """stats[first_slot + 2w ..] = (max |g|, sum of (g / max)^2) of chunk w of the
    gradient; bindings: grad (read), stats (read_write)."""
    return _finish("train:sum_squares", "reduction", "sum_squares.wgsl", ["grad"], ["f32"], "f32",
                   [n, first_slot], grid_1d(norm_partials(n)), CHUNK=NORM_CHUNK)


def norm_total_kernel(count: int) -> Kernel:
    """stats[1] = the gradient norm from ``count`` partials at stats[2:]; binding: stats
    (read_write)."""
    return _finish("train:norm_total", "reduction", "norm_total.wgsl", [], [], "f32", [count], (1, 1, 1))


def optimizer_kernel(n: int, kind: str, lr_multiplier: float, weight_decay: float,
                     momentum: float, betas, eps: float, clip_norm: float | None) -> Kernel:
    """In-place update of one parameter; bindings: grad, stats, step (read), p, s1, s2 (read_write)."""
    meta = [n, 0, OPTIMIZER_KINDS[kind], f32_bits(lr_multiplier), f32_bits(weight_decay),
            f32_bits(momentum), f32_bits(betas[0]), f32_bits(betas[1]), f32_bits(eps),
            f32_bits(clip_norm or 0.0)]
    return _finish(f"train:{kind}", "optimizer", "optimizer.wgsl", ["grad", "stats", "step"],
                   ["f32"] * 3, "f32", meta, grid_1d(-(-n // WG)))


def gradient_copy_kernel(n: int) -> Kernel:
    """out[i] = in0[i] for i < n, on the copy template: a gradient whose node cannot be
    computed in its arena slot (it is an input, a parameter, a constant, another
    output's node, or shared by two parameters) is copied there. Bindings: in0 (read),
    out (read_write). The size is in meta, so every such copy shares one pipeline."""
    return _finish("copy:gradient", "copy", "copy.wgsl", ["in0"], ["f32"], "f32", [n, n],
                   grid_1d(-(-n // WG)), RANK=1, AXIS=0,
                   PIECES="    if (c < m(1u)) { out[idx] = in0[idx]; return; }", ZERO="f32(0)")
