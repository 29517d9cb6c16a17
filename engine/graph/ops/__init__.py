"""The op table: every op of the IR is declared here, once.

An ``OpDef`` holds what the rest of the engine needs to know about an op: how its
output shape and dtype follow from its operands (``shape``), what it computes in
numpy (``ref``, the oracle every other backend is checked against), its gradient
(``grad``, filled in by the autodiff table) and the kernel archetype that runs it
on the GPU. Adding an op means adding one entry here.

Shapes are tuples of ints, dtypes are ``"f32"`` or ``"i32"``. Reference functions
receive numpy arrays already cast to the executor's float type and the node's
attributes, and return one array.

The table is one package: ``table`` (what an op is, ``OPS``, ``defop``), then the
declarations, in the order they enter ``OPS``: ``forward``, ``backward`` (gradients'
ops), ``onnx`` (what the ONNX importer adds), ``generation`` (the KV cache's ops). Everything is importable from here.
"""

from .table import (  # noqa: F401
    ARCHETYPES, ATTENTION, CONV, COPY, GATHER, MATMUL, OPS, OpDef, OpShapeError, POINTWISE,
    REDUCTION, SOURCE, Shape, TensorType, VIEW, broadcast_shapes, defop)
from .forward import (  # noqa: F401
    ACTIVATION_OPS, ACTIVATIONS, BINARY, GRADIENT_OF, PART_ALIGN, UNARY, attention_grad_kv_layout, attention_grad_kv_ref,
    attention_grad_q_ref,
    attention_lse_ref, attention_ref, attention_scores, attention_stats_layout, attention_stats_ref, bce_ref,
    check_index_range, conv_ref, entry_of,
    cross_entropy_ref, embedding_ref, fused_matmul_ref, gelu_ref, group_norm_ref, layer_norm_ref,
    log_softmax_ref, matmul_ref, merge_heads, norm_matmul_ref, packed_layout, pad_ref, part_ref, rms_norm_ref, rope_ref,
    rope_inverse_frequencies, rope_tables, run_program, sigmoid_ref, slice_ref, soft_cross_entropy_ref, softmax_ref,
    split_heads, sum_to_ref, tiled_attention_head_dim)
from .backward import (  # noqa: F401
    BACKWARD_OPS, conv_input_grad_ref, conv_weight_grad_ref, cross_entropy_grad_ref,
    embedding_grad_ref, gelu_grad_ref, max_grad_ref, norm_grad_ref, norm_param_grad_ref)
from .onnx import (  # noqa: F401
    ONNX_UNARY, cast_ref, conv_general_input_grad_ref, conv_general_ref,
    conv_general_weight_grad_ref, max_pool_grad_ref, pool_divisor, pool_geometry, pool_ref)
from .generation import (  # noqa: F401
    argmax_ref, cache_write_ref, cached_attention_ref, norm_matmuls_layout, norm_matmuls_ref, product_weights,
    swiglu_matmul_ref)
