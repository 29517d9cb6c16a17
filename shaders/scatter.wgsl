// Embedding gradient (scatter-add without atomics): one thread per table element
// [v, j] walks every id and sums the dout rows that picked row v. Deterministic.
// meta: [total, dim, rows]

{{PRELUDE}}

{{BINDINGS}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    let dim = m(1u);
    let v = i32(idx / dim);
    let j = idx % dim;
    var acc = 0.0;
    for (var r = 0u; r < m(2u); r = r + 1u) {
        if (ids[r] == v) { acc = acc + dout[r * dim + j]; }
    }
    out[idx] = acc;
}
