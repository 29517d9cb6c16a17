// A KV cache write, in place: out (the cache [B, S, W], or [P, B, S, W] with a plane per x:
// a layer's keys and values in one dispatch) row positions[b, t] = x_p[b, t] (x [B, T, W]),
// the first x rotated by RoPE at that position first where codegen says so (heads of d
// values; d = 0 without); one thread per element of the x's. A position outside [0, S)
// writes nothing.
// meta: [total, T, S, W, d, elements of one x, elements of one plane, inv_freq[d/2]]

{{PRELUDE}}

{{BINDINGS}}

{{ROPE_FN}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    let T = m(1u); let S = m(2u); let W = m(3u); let d = max(m(4u), 1u);
    let plane = idx / m(5u);
    let e = idx % m(5u);
    let row = e / W;
    let pos = positions[row];
    if (pos < 0 || u32(pos) >= S) { return; }
    let i = e % W % d;
    var v = 0.0;
{{VALUE}}
    out[plane * m(6u) + (row / T * S + u32(pos)) * W + e % W] = v;
}
