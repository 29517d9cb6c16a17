"""WGSL for one dispatch: kernel archetypes as templates in ``shaders/``.

There is no shader per op. Each archetype is a module here on templates of its own
(``pointwise``, ``matmul``, ``reduction``, ``copies``, ``convolution``, ``pooling``
(max/avg pooling and the direct N-d ``conv_general``), ``attention``, ``training``),
sharing ``common`` (``Capabilities``, ``Kernel``, template rendering).
``dispatch.kernel_for`` picks the builder of a node's op and returns a ``Kernel``: the
WGSL source, the binding layout, the per-dispatch parameter words ("meta") and the
workgroup counts. Imports ``engine.graph`` and ``engine.errors`` only.
"""

from .attention import (ATTENTION_BACKWARD, ATTENTION_MAX_SPLITS, ATTENTION_MIN_PART,
                        attention_backward_bytes, attention_backward_rows, attention_queries, attention_splits,
                        attention_variant, attention_workgroup_bytes, cached_attention_parts,
                        cached_attention_writing)
from .attention_coop_backward import scores_pair
from .common import (MAX_WORKGROUPS, PLAIN, SUBGROUP_MATRIX_FEATURE, THREAD_LAYOUTS,
                     Capabilities, Kernel, UnsupportedOpError, forward_nodes, grid_1d, precision)
from .dispatch import (describe_paths, kernel_for, product_combining, product_with_argmax, reads_bf16,
                       supported_ops, unsupported_ops)
from .matmul import (MATMUL_KERNELS, MATMUL_MAX_SPLITS, TILED, matmul_splits, matmul_variant,
                     narrow_tiles_fill_better, split_rule)
from .matmul_coop import COOP, coop_workgroup_bytes
from .reduction import argmax_of_partials, norm_gradients, norm_gradients_kernel
from .tile_operands import operand_fetch
from .tuning import TUNED_FIELDS, Tuning
from .training import (gradient_copy_kernel, norm_partials, norm_total_kernel, optimizer_kernel,
                       sum_squares_kernel)

__all__ = [name for name in dir() if not name.startswith("_")]
