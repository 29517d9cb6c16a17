// Embedding gradient (scatter-add without atomics): out[v, j] = sum of dout[r, j] over the
// rows r whose id is v, in the order of r (deterministic).
// A workgroup owns ROWS rows of the table and 64 of its columns: it streams the ids of its
// part through workgroup memory once, and a thread adds dout[r, j] into the one of its ROWS
// accumulators that the id picks (a uniform test: no thread walks ids alone). Workgroup z
// takes the PER rows of dout from z PER on: with more than one part (a small table, many
// ids) each writes its own copy of the table, which a second dispatch adds in part order.
// meta: [vocab, dim, rows of dout, PER]

{{PRELUDE}}

{{BINDINGS}}

const ROWS: u32 = {{ROWS}}u;
var<workgroup> ids_s: array<i32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let vocab = m(0u);
    let dim = m(1u);
    let rows = m(2u);
    let v0 = wg.x * ROWS;
    let j = wg.y * 64u + lid.x;
    let first = wg.z * m(3u);
    let last = min(rows, first + m(3u));
    var acc: array<f32, ROWS>;
    for (var i = 0u; i < ROWS; i = i + 1u) { acc[i] = 0.0; }
    for (var r0 = first; r0 < last; r0 = r0 + 64u) {
        workgroupBarrier();
        if (r0 + lid.x < last) { ids_s[lid.x] = ids[r0 + lid.x]; }
        workgroupBarrier();
        let n = min(64u, last - r0);
        for (var k = 0u; k < n; k = k + 1u) {
            let d = ids_s[k] - i32(v0);
            if (d >= 0 && d < i32(ROWS) && j < dim) {
                acc[u32(d)] = acc[u32(d)] + dout[(r0 + k) * dim + j];
            }
        }
    }
    if (j < dim) {
        for (var i = 0u; i < ROWS; i = i + 1u) {
            if (v0 + i < vocab) { out[(wg.z * vocab + v0 + i) * dim + j] = acc[i]; }
        }
    }
}
