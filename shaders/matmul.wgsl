// Tiled matmul archetype: C[b] = epilogue(prologue(A[b]) @ B[b]), a 16 x 64 output tile per
// workgroup, four adjacent outputs of a row a thread, K in steps of 16 through workgroup memory.
// Four outputs a thread, not one: each element staged serves four products, which took
// lavapipe's time for a [24, 384] x [384, 1536] product from 217 to 107 ms (2026-11-27).
// Transposes and batch broadcasting are strides: operand (row, col) of batch b lives at
// boff(b, operand) + row * s_row + col * s_col.
// meta: [M, N, K, nbatch, eps, batch_shape[BR], per operand: batch_strides[BR], s_row, s_col]
// operands: 0 = A, 1 = B, then the epilogue operands (add, residual).

{{PRELUDE}}

{{BINDINGS}}

const BR: u32 = {{BR}}u;
const TS: u32 = 16u;

var<workgroup> As: array<array<f32, 16>, 16>;
var<workgroup> Bs: array<array<vec4<f32>, 16>, 16>;

{{OPERANDS}}

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let M = m(0u);
    let N = m(1u);
    let K = m(2u);
    let b = wg.z;
    let row = wg.y * TS + lid.y;
    let col0 = (wg.x * TS + lid.x) * 4u;
    let a0 = boff(b, 0u);
    let b0 = boff(b, 1u);
    let sam = srow(0u);
    let sak = scol(0u);
    let sbk = srow(1u);
    let sbn = scol(1u);
    var acc = vec4<f32>();
    for (var k0 = 0u; k0 < K; k0 = k0 + TS) {
        let ka = k0 + lid.x;
        var av = 0.0;
        if (row < M && ka < K) {
            av = a_in[a0 + row * sam + ka * sak]{{A_PROLOGUE}};
        }
        As[lid.y][lid.x] = av;
        let kb = k0 + lid.y;
        var bv = vec4<f32>();
        if (kb < K && col0 < N) {
{{LOAD_B}}
        }
        Bs[lid.y][lid.x] = bv;
        workgroupBarrier();
        for (var kk = 0u; kk < TS; kk = kk + 1u) {
            acc = acc + As[lid.y][kk] * Bs[kk][lid.x];
        }
        workgroupBarrier();
    }
    if (row >= M) { return; }
{{ROW_SETUP}}
    for (var j = 0u; j < 4u && col0 + j < N; j = j + 1u) {
        let col = col0 + j;
        var v = acc[j];
{{EPILOGUE}}
        out[(b * M + row) * N + col] = v;
    }
}
