// Register-blocked matmul archetype: C[b] = epilogue(A[b] @ B[b]). 256 threads (16 x 16)
// per workgroup, a {{BM}} x {{BN}} output tile, {{TM}} x {{TN}} outputs per thread held in
// named vec4 registers, K in steps of 8 through workgroup memory stored k-major (so a
// thread reads 4 rows of A and 4 columns of B as one vec4 each). A thread's rows are
// g * 64 + ty * 4 + 0..3 (g < TM / 4), its columns h * 64 + tx * 4 + 0..3 (h < TN / 4).
// Strides, transposes, batch broadcasting and epilogue as in matmul.wgsl (same meta).
// meta: [M, N, K, nbatch, eps, batch_shape[BR], per operand: batch_strides[BR], s_row, s_col]

{{PRELUDE}}

{{BINDINGS}}

const BR: u32 = {{BR}}u;
const BM: u32 = {{BM}}u;
const BN: u32 = {{BN}}u;
const BK: u32 = 8u;
const AS: u32 = {{AS}}u;   // vec4 slots per k row of As: BM / 4 + 1 (padding against bank conflicts)
const BS: u32 = {{BS}}u;

var<workgroup> As: array<vec4<f32>, {{A_SLOTS}}>;
var<workgroup> Bs: array<vec4<f32>, {{B_SLOTS}}>;

{{OPERANDS}}

fn store(b: u32, row: u32, col: u32, acc: f32) {
    let M = m(0u);
    let N = m(1u);
    if (row >= M || col >= N) { return; }
    var v = acc;
{{EPILOGUE}}
    out[(b * M + row) * N + col] = v;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let M = m(0u);
    let N = m(1u);
    let K = m(2u);
    let b = wg.z;
    let tx = tid % 16u;
    let ty = tid / 16u;
    let row0 = wg.y * BM;
    let col0 = wg.x * BN;
    let a0 = boff(b, 0u);
    let b0 = boff(b, 1u);
    let sam = srow(0u);
    let sak = scol(0u);
    let sbk = srow(1u);
    let sbn = scol(1u);
    let a_kfast = sak == 1u;
    let b_nfast = sbn == 1u;
{{ACC_DECL}}
    for (var k0 = 0u; k0 < K; k0 = k0 + BK) {
        for (var i = 0u; i < BM / 32u; i = i + 1u) {
            let e = tid + i * 256u;
            var r = e % BM;
            var kk = e / BM;
            if (a_kfast) { r = e / BK; kk = e % BK; }
            let gr = row0 + r;
            let gk = k0 + kk;
            var v = 0.0;
            if (gr < M && gk < K) { v = a_in[a0 + gr * sam + gk * sak]; }
            As[kk * AS + r / 4u][r % 4u] = v;
        }
        for (var i = 0u; i < BN / 32u; i = i + 1u) {
            let e = tid + i * 256u;
            var c = e / BK;
            var kk = e % BK;
            if (b_nfast) { c = e % BN; kk = e / BN; }
            let gc = col0 + c;
            let gk = k0 + kk;
            var v = 0.0;
            if (gc < N && gk < K) { v = b_in[b0 + gk * sbk + gc * sbn]; }
            Bs[kk * BS + c / 4u][c % 4u] = v;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk = kk + 1u) {
{{COMPUTE}}
        }
        workgroupBarrier();
    }
{{STORE}}
}
