// Matmul archetype for a few rows (a decode step's M = 1): C[b] = epilogue(prologue(A[b]) @ B[b])
// with ROWS rows, COLS output columns a workgroup and SLICES threads splitting K for each.
// Threads follow B's contiguous axis: lanes over columns where B's columns are contiguous
// (COL_OF = t % COLS), over K where its rows are (a transposed B: COL_OF = t / SLICES), so
// every warp reads whole cache lines of the weights, the only large operand. The slices'
// partial sums meet in workgroup memory. Same meta and operand addressing as matmul.wgsl.
// Codegen fills the EXTRA slots for a second B (swiglu_matmul's up weight, operand 2,
// accumulated beside the first) and for an RMS norm of A in the prologue (its sums of
// squares gathered by the same loads, one partial per K slice); they are empty otherwise.
// COLUMNS says which B a workgroup multiplies (wsel) and where its columns go: one B of N
// columns, or (norm_matmuls) several Bs, operands 1.., each with its own workgroups and
// its own place (out0) in the packed result. Workgroup y takes one slice of K, SPAN long:
// where the columns' workgroups are too few to fill the GPU, each slice writes its raw
// sums (and its second sums, its sums of squares) and matmul_splits.wgsl adds them up
// and applies the epilogue (codegen's _split_stores in EPILOGUE's place).
// A B stored in bf16 (engine.optimize.bf16_weights) is read through codegen's stored_load: the u32
// word holding the element, widened (common.wgsl's bf16_); or, WIDTH = 4, four columns a thread
// from two words at once (bf16x4_), the sums vec4s (ACC). Where B is stored transposed (a
// weight kept [out, in]), DEPTH = 4 gives each thread four consecutive K steps a load, two
// bf16 words or an f32 vec4, so that a warp reads 256 or 512 contiguous bytes of a column;
// ka then counts steps of DEPTH. AFTER_OUT and AFTER_LOOP (codegen's product_with_argmax)
// leave a one-row product's workgroup's best value and its column for the argmax.
// meta: [M, N, K, nbatch, eps, batch_shape[BR], per operand: batch_strides[BR], s_row, s_col,
//        K slices, SPAN]

{{PRELUDE}}

{{BINDINGS}}

const BR: u32 = {{BR}}u;
const ROWS: u32 = {{ROWS}}u;
const COLS: u32 = {{COLS}}u;
const SLICES: u32 = {{SLICES}}u;
const UNROLL: u32 = {{UNROLL}}u;
const WIDTH: u32 = {{WIDTH}}u;   // consecutive columns a thread, its sums an ACC
const DEPTH: u32 = {{DEPTH}}u;   // consecutive K steps a thread loads at once
const SPAN_WORD: u32 = {{SPAN_WORD}}u;   // the meta word of a K slice's length

var<workgroup> part: array<{{ACC}}, {{PARTIAL}}>;
{{EXTRA_DECL}}

{{OPERANDS}}

@compute @workgroup_size({{THREADS}})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let M = m(0u);
    let K = m(2u);
{{COLUMNS}}
    let b = wg.z;
    let t = lid.x;
    let c = {{COL_OF}};
    let s = {{SLICE_OF}};
    let a0 = boff(b, 0u);
    let b0 = boff(b, 1u);
    let sam = srow(0u);
    let sak = scol(0u);
    let sbk = srow(1u + wsel);
    let sbn = scol(1u + wsel);
{{EXTRA_SETUP}}
    let col_b = (wx * COLS + c) * WIDTH;
    let k_lo = wg.y * m(SPAN_WORD) / DEPTH;
    let k_hi = min(K, (wg.y + 1u) * m(SPAN_WORD)) / DEPTH;
    var acc: array<{{ACC}}, ROWS>;
    if (col_b < N) {
        // UNROLL steps of K at a time, their loads independent: one load in flight per
        // thread left the kernel waiting on memory latency (17 us for 576 x 576 on the H100).
        var ka = k_lo + s;
        for (; ka + (UNROLL - 1u) * SLICES < k_hi; ka = ka + UNROLL * SLICES) {
{{ACCUMULATE_UNROLLED}}
        }
        for (; ka < k_hi; ka = ka + SLICES) {
{{ACCUMULATE}}
        }
    }
    for (var r = 0u; r < ROWS; r = r + 1u) { part[(r * COLS + c) * SLICES + s] = acc[r]; }
{{EXTRA_STORE}}
    workgroupBarrier();
    for (var o = t; o < ROWS * COLS * WIDTH; o = o + COLS * SLICES) {
        let row = o / (COLS * WIDTH);
        let within = o % (COLS * WIDTH);
        let col = wx * COLS * WIDTH + within;
        if (col >= N) { continue; }
        let pi = (row * COLS + within / WIDTH) * SLICES;   // this column's sums, slice after slice
        let lane = within % WIDTH;
        var v = 0.0;
        for (var j = 0u; j < SLICES; j = j + 1u) { v = v + part[pi + j]{{LANE}}; }
{{EXTRA_SUM}}
{{EPILOGUE}}
        out[{{OUT_AT}}] = v;
{{AFTER_OUT}}
    }
{{AFTER_LOOP}}
}
