// Embedding gradient (scatter-add without atomics): out[v, j] = sum of dout[r, j] over the
// rows r whose id is v, in the order of r (deterministic).
// A workgroup owns ROWS rows of the table and 64 of its columns: it streams the ids of its
// part through workgroup memory once, CHUNK at a time, and a thread adds dout[r, j] into the
// one of its ROWS accumulators that the id picks (a uniform test: no thread walks ids
// alone); where a chunk holds fewer than one id of a workgroup's rows on average (SKIP: a
// large vocabulary), a chunk with none is skipped after one count. Workgroup z
// takes the PER rows of dout from z PER on: with more than one part (a small table, many
// ids) each writes its own copy of the table, which a second dispatch adds in part order.
// meta: [vocab, dim, rows of dout, PER]

{{PRELUDE}}

{{BINDINGS}}

const ROWS: u32 = {{ROWS}}u;
const CHUNK: u32 = {{CHUNK}}u;              // ids streamed at a time, CHUNK / 64 a thread
const SKIP: bool = {{SKIP}};                // test each chunk for ids of the workgroup's rows
var<workgroup> ids_s: array<i32, CHUNK>;
var<workgroup> hit_count: atomic<u32>;      // threads that loaded an id of this workgroup's rows
var<workgroup> hit_flag: u32;

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
    for (var r0 = first; r0 < last; r0 = r0 + CHUNK) {
        workgroupBarrier();             // the previous chunk's ids are read
        var mine = false;
        for (var q = 0u; q < CHUNK; q = q + 64u) {
            var id = -1;
            if (r0 + q + lid.x < last) { id = ids[r0 + q + lid.x]; }
            ids_s[q + lid.x] = id;
            let d = id - i32(v0);
            mine = mine || (d >= 0 && d < i32(ROWS));
        }
        if (SKIP) {   // a large table's workgroup sees few of its ids: most chunks end here
            if (mine) { atomicAdd(&hit_count, 1u); }
            workgroupBarrier();
            if (lid.x == 0u) { hit_flag = atomicExchange(&hit_count, 0u); }
            if (workgroupUniformLoad(&hit_flag) == 0u) { continue; }
        } else {
            workgroupBarrier();
        }
        let n = min(CHUNK, last - r0);
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
