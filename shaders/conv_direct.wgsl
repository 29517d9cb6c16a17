// Direct N-d convolution (conv_general: stride, begin/end zero pads, dilation, groups):
// one thread per output element [n, o, pos...] sums its window (window.wgsl) over the
// input channels of its group, zero outside the input.
// meta: [total, O, CG (input channels a group), OG (outputs a group), C, taps, in_size,
//        then the window fields from word 7: out, in, kernel, stride, pad_begin, dilation]

{{PRELUDE}}

{{BINDINGS}}

const ND: u32 = {{ND}}u;

{{WINDOW}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    var pos: array<u32, ND>;
    let rem = unravel_(idx, 0u, &pos);
    let o = rem % m(1u);
    let batch = rem / m(1u);
    let cg = m(2u);
    let taps = m(5u);
    let in_size = m(6u);
    let x_base = (batch * m(4u) + o / m(3u) * cg) * in_size;
    let w_base = o * cg * taps;
    var acc = 0.0;
    for (var t = 0u; t < taps; t = t + 1u) {
        let off = tap_(&pos, t);
        if (off >= 0) {
            for (var ci = 0u; ci < cg; ci = ci + 1u) {
                acc = acc + x_in[x_base + ci * in_size + u32(off)] * w_in[w_base + ci * taps + t];
            }
        }
    }
{{BIAS}}
    out[idx] = acc;
}
