// Row-reduction archetype for short rows (N <= SHORT_ROW, e.g. attention's Delta, rows of
// a head dimension): one thread per row, its elements loaded 8 at a time before they are
// combined. A workgroup of 256 threads a row left 192 of them idle on rows of 64 and made
// one workgroup of 72,000 rows (whisper-tiny's Delta at batch 8: 72 us on the H100).
// meta: [rows, N, eps]

{{PRELUDE}}

{{BINDINGS}}

fn combine(a: f32, b: f32) -> f32 { return {{COMBINE}}; }

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = (wg.y * nwg.x + wg.x) * 256u + lid.x;
    let N = m(1u);
    if (row >= m(0u)) { return; }
    let base = row * N;
    var s = {{INIT}};
    var i = 0u;
    for (; i + 7u < N; i = i + 8u) {
        let v0 = x[base + i]; let v1 = x[base + i + 1u]; let v2 = x[base + i + 2u]; let v3 = x[base + i + 3u];
        let v4 = x[base + i + 4u]; let v5 = x[base + i + 5u]; let v6 = x[base + i + 6u]; let v7 = x[base + i + 7u];
        s = combine(s, combine(combine(combine(v0, v1), combine(v2, v3)), combine(combine(v4, v5), combine(v6, v7))));
    }
    for (; i < N; i = i + 1u) { s = combine(s, x[base + i]); }
    out[row] = {{FINISH}};
}
