// Rotary position embedding (rotate-half form) on [batch, seq, heads*dim]: one thread per
// output element. The inverse frequencies come in meta (computed in float64 on the host).
// meta: [total, seq, width, dim, offset, inverse, inv_freq[dim/2]]

{{PRELUDE}}

{{BINDINGS}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    let seq = m(1u);
    let width = m(2u);
    let d = m(3u);
    let half = d / 2u;
    let pos = (idx / width) % seq + m(4u);
    let i = (idx % width) % d;
    let head0 = idx - i;
    let j = i % half;
    let ang = f32(pos) * mf(6u + j);
    let c = cos(ang);
    var s = sin(ang);
    if (m(5u) != 0u) { s = -s; }
    let x1 = x[head0 + j];
    let x2 = x[head0 + j + half];
    if (i < half) {
        out[idx] = x1 * c - x2 * s;
    } else {
        out[idx] = x2 * c + x1 * s;
    }
}
