// Gather archetype: out[r, j] = table[ids[r], j]; ids out of [0, vocab) give zeros.
// meta: [total, dim, vocab]

{{PRELUDE}}

{{BINDINGS}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    let dim = m(1u);
    let id = ids[idx / dim];
    var v = 0.0;
    if (id >= 0 && u32(id) < m(2u)) {
        let at = u32(id) * dim + idx % dim;
        v = {{TABLE_AT}};
    }
    out[idx] = v;
}
