// Rotary position embedding (rotate-half form) on [batch, seq, heads*dim]: one thread per
// output element, at position offset + t or (a generation step) positions[b, t]. The
// inverse frequencies come in meta (computed in float64 on the host).
// meta: [total, seq, width, dim, offset, inverse, inv_freq[dim/2]]

{{PRELUDE}}

{{BINDINGS}}

{{ROPE_FN}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    let seq = m(1u);
    let width = m(2u);
    let d = m(3u);
    let half = d / 2u;
    let pos = {{POSITION}};
    let i = (idx % width) % d;
    let head0 = idx - i;
    let j = i % half;
    out[idx] = rope_(x[head0 + j], x[head0 + j + half], i, d, pos, 6u, m(5u) != 0u);
}
