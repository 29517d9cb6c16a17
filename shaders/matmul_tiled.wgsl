// Tiled matmul archetype: C[b] = epilogue(A[b] @ B[b]), {{THREADS}} threads a workgroup, a {{BM}} x {{BN}}
// output tile. Two ways to multiply a tile (codegen fills COMPUTE, the tiles and STORE_OUT):
// f32 registers ({{TM}} x {{TN}} outputs per thread in named vec4s, described here) or
// cooperative matrices (each subgroup owns 16 x 16 f16 x f16 -> f32 fragments; the operand
// tiles are f16, and results leave through a 16 x 16 f32 scratch of the subgroup's). Either
// way results leave 4 columns at a time through store4(), which applies the epilogue and
// bounds: where N is a multiple of 4 and results go to (z * M + row) * N + col, `out` is
// bound as vec4s and each 4 columns are one write (four scalar writes a lane cost
// whisper-tiny's f16 encoder at batch 8 6% of its time on the H100, run 40).
// K advances in steps of BK ({{BK}}) through two workgroup buffers: while the threads
// multiply out of one, the next step's operands are already loaded from
// global memory into registers and go into the other afterwards, so one barrier per step
// suffices and the global loads overlap the arithmetic. Tiles are stored k-major (a
// thread reads 4 rows of A and 4 columns of B as one vec4 each) with one vec4 of padding
// per k row against bank conflicts. Thread (tx, ty) of 16 x TY, TY = THREADS / 16
// (THREAD_XY: codegen's thread layouts; a warp is 16 x 2 of them). A thread's rows are
// g * 4 TY + ty * 4 + 0..3 (g < TM / 4), its columns h * 64 + tx * 4 + 0..3 (h < TN / 4).
// How each operand is fetched (vec4 loads along whichever axis is contiguous, or scalar
// loads through the strides) is generated per operand layout by codegen.
// Split-K (for outputs of too few tiles to fill the GPU; the grid's z is nbatch x the
// slices, so kernels of any slice count share a pipeline): workgroup z covers
// batch z % nbatch and the K slice z / nbatch, a whole number of BK steps, and writes its
// raw sums to slice z of `out` (partials); matmul_splits.wgsl adds the slices and applies
// the epilogue, which is then empty here.
// Scaled operands (cooperative products of gradients; KEPT_SCALES, ATTEMPT_BEGIN/END): the
// K loop runs with the scale this workgroup's operand took at the previous step, finds
// the operand's true range as it goes, and runs once more where that scale was not the
// one the range asks for (codegen's _coop_scales).
// Strides, transposes, batch broadcasting and epilogue as in matmul.wgsl (same meta).
// Sums (SUMS_*; a weight gradient's product beside its bias gradient, which reads the same
// operand): each thread also adds up the registers it fetches of one operand (where it
// stores them, so that the adds wait for no load the stores did not already), and the
// workgroups of the first tile column (A's rows) or row (B's columns) add the threads'
// sums into that operand's sums over their K range, written to `sums_out` (or after all
// the slices' results in the partials, for the finish to add).
// OUT_AT: where result (z, row, col) goes, (z * M + row) * N + col unless codegen maps
// the columns elsewhere (a strided convolution's input gradient; never split).
// meta: [M, N, K, nbatch, eps, batch_shape[BR], per operand: batch_strides[BR], s_row, s_col]

{{PRELUDE}}

{{BINDINGS}}

const BR: u32 = {{BR}}u;
const BM: u32 = {{BM}}u;
const BN: u32 = {{BN}}u;
const BK: u32 = {{BK}}u;
const AS: u32 = {{AS}}u;   // slots a row of the A tile (f32: vec4s a k row, BM / 4 + 1)
const BS: u32 = {{BS}}u;
const ABUF: u32 = {{ABUF}}u; // slots of one of the two buffers (f32: BK * AS; 0: one buffer, RESTAGE waits)
const BBUF: u32 = {{BBUF}}u;

{{SMEM}}

{{OPERANDS}}

fn epilogue(b: u32, row: u32, col: u32, acc: f32) -> f32 {
    var v = acc;
{{EPILOGUE}}
    return v;
}

fn store(b: u32, z: u32, row: u32, col: u32, acc: f32) {
    let M = m(0u);
    let N = m(1u);
    if (row >= M || col >= N) { return; }
{{OUT_AT}}
{{STORE_ONE}}
}

// Results (row, col .. col + 3): one vec4 write where `out` is bound as vec4s, else four store()s.
fn store4(b: u32, z: u32, row: u32, col: u32, acc: vec4<f32>) {
{{STORE_FOUR}}
}

@compute @workgroup_size({{THREADS}}){{MAIN_ATTRS}}
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32{{ARGS}}) {
    let M = m(0u);
    let N = m(1u);
    let K = m(2u);
    let part = wg.z / m(3u);
    let b = wg.z - part * m(3u);
    let splits = nwg.z / m(3u);
    let kslice = (K + splits * BK - 1u) / (splits * BK) * BK;
    let kbeg = part * kslice;
    let kend = min(K, kbeg + kslice);
{{THREAD_XY}}
    let row0 = wg.y * BM;
    let col0 = wg.x * BN;
    let a0 = boff(b, 0u);
    let b0 = boff(b, 1u);
    let sam = srow(0u);
    let sak = scol(0u);
    let sbk = srow(1u);
    let sbn = scol(1u);
{{LOAD_DECL}}
{{ACC_DECL}}
{{KEPT_SCALES}}
{{ATTEMPT_BEGIN}}
{{SUMS_RESET}}
    var kb = kbeg;
    if (kbeg < kend) {   // a split's last slice may be empty: fetch nothing past K
{{LOAD}}
    }
    var buf = 0u;
{{STORE}}
{{SUMS_ADD}}
    workgroupBarrier();
    for (var k0 = kbeg; k0 < kend; k0 = k0 + BK) {
        kb = k0 + BK;
        let more = kb < kend;
        if (more) {
{{LOAD}}
        }
        let ab = buf * ABUF;
        let bb = buf * BBUF;
{{COMPUTE}}
{{RESTAGE}}
        if (more) {
            buf = buf ^ 1u;
{{STORE}}
{{SUMS_ADD}}
        }
        workgroupBarrier();
    }
{{ATTEMPT_END}}
{{SUMS_OUT}}
{{STORE_OUT}}
}
