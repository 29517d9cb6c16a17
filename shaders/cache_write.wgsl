// A KV cache write, in place: out (the cache [B, S, W]) row positions[b, t] = x[b, t]
// (x [B, T, W]), rotated by RoPE at that position first where codegen says so (heads of
// d values; d = 0 without); one thread per element of x. A position outside [0, S)
// writes nothing.
// meta: [total, T, S, W, d, inv_freq[d/2]]

{{PRELUDE}}

{{BINDINGS}}

{{ROPE_FN}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    let T = m(1u); let S = m(2u); let W = m(3u); let d = max(m(4u), 1u);
    let row = idx / W;
    let pos = positions[row];
    if (pos < 0 || u32(pos) >= S) { return; }
    let i = idx % W % d;
    out[(row / T * S + u32(pos)) * W + idx % W] = {{VALUE}};
}
