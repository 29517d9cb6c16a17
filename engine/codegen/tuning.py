"""How many workgroups fill the adapter, and which tile wins: the numbers kernel choices
depend on, per adapter.

A kernel with too few workgroups leaves processors idle, so codegen splits long
reductions (split-K matmuls, streamed attention, sums) until the grid fills the GPU.
How many workgroups "fill" it depends on the GPU: WebGPU reports no processor count, so
``meganeura tune`` (engine/runtime/tuning.py) times the kernels that use each number at
several values on the adapter and caches the winners; plans read them through
``Capabilities.tuning``. Without a measurement the defaults assume a large GPU, because
filling past a small GPU costs a finishing pass over partial results while leaving a
large one idle costs most of its speed. Software adapters (lavapipe) keep the defaults
too: speed is not what they are for, and they then exercise the same kernel paths
(split-K, split attention) as a GPU does.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Tuning:
    """Workgroups that fill the adapter, per kernel family, and where the smaller
    cooperative kernels win (each field's comment says which rule reads it). ``source``
    says where they came from: "default" or "tuned" (``meganeura tune`` measured them on
    this adapter)."""

    matmul_resident: int = 512   # 64 x 64 matmul workgroups in one wave: split-K, the 128 and coop tiles
    attention_fill: int = 768    # attention workgroups below which the streamed side splits
    sum_workgroups: int = 128    # sum_to outputs widen their lanes, norm_param_grad chunks shrink, below this many workgroups
    lean_k: int = 1024           # K a cooperative matmul workgroup runs up to which it takes the lean tile: coop_variant
    dq_long_stream: int = 512    # keys a cooperative dq workgroup streams from which blocks of 32 win: backward_streamed
    narrow_columns: int = 384    # columns up to which a cooperative product K does not split takes 128 x 96 tiles
                                 # where they fill better, over a short K too: coop_variant
    wide_fill: int = 256         # 128-row cooperative workgroups that a long K's slices aim for where they
                                 # take that tile for their slices (slice_fill); matmul_resident counts 64 x 64 ones
    dq_prefetch: int = 2         # blocks ahead that attention's dq product fetches K and dS (1 to 4):
                                 # coop_dq_from_scores
    split_small_cost: int = 8    # a 64 x 64 split product workgroup's K step, in 16ths of a 128 x 128
                                 # one's (f32 as three f16 products): split_variant
    vector_small_kib: int = 16384   # a few-row product's B under this many KiB keeps 8 columns a
                                    # workgroup and all of K, where the dispatch is the cost: vector_layout
    vector_deep_columns: int = 1    # columns a thread of a one-row product whose weights are kept [out, in]
                                    # takes, sharing its A loads (1, 2 or 4): deep_width
    source: str = "default"

    def __post_init__(self):
        for f in fields(self):
            if f.type == "int" and (not isinstance(getattr(self, f.name), int) or getattr(self, f.name) < 1):
                raise ValueError(f"tuning {f.name} must be a positive whole number, not {getattr(self, f.name)!r}")

    @classmethod
    def from_dict(cls, data: dict) -> "Tuning":
        """The tuning a plan or cache file stored (unknown keys, from another version, are refused)."""
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown tuning fields {sorted(unknown)}")
        return cls(**data)


TUNED_FIELDS = tuple(f.name for f in fields(Tuning) if f.name != "source")
