// Direct N-d convolution (conv_general: stride, begin/end zero pads, dilation, groups):
// one thread per output element [n, o, pos...] sums its window over the input channels
// of its group. A tap at output position p, kernel offset k reads input position
// p * stride + k * dilation - pad_begin, zero outside the input.
// meta: [total, O, CG (input channels a group), OG (outputs a group), C, taps, in_size,
//        out[ND], in[ND], kernel[ND], stride[ND], pad_begin[ND], dilation[ND]]

{{PRELUDE}}

{{BINDINGS}}

const ND: u32 = {{ND}}u;

fn g(field: u32, d: u32) -> u32 { return m(7u + field * ND + d); }

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    var pos: array<u32, ND>;
    var rem = idx;
    for (var d = i32(ND) - 1; d >= 0; d = d - 1) {
        let n = g(0u, u32(d));
        pos[d] = rem % n;
        rem = rem / n;
    }
    let o = rem % m(1u);
    let batch = rem / m(1u);
    let cg = m(2u);
    let taps = m(5u);
    let in_size = m(6u);
    let x_base = (batch * m(4u) + o / m(3u) * cg) * in_size;
    let w_base = o * cg * taps;
    var acc = 0.0;
    for (var t = 0u; t < taps; t = t + 1u) {
        var r = t;
        var off = 0u;
        var mult = 1u;
        var inside = true;
        for (var d = i32(ND) - 1; d >= 0; d = d - 1) {
            let ud = u32(d);
            let k = g(2u, ud);
            let kd = r % k;
            r = r / k;
            let p = i32(pos[d] * g(3u, ud) + kd * g(5u, ud)) - i32(g(4u, ud));
            let n_in = i32(g(1u, ud));
            inside = inside && p >= 0 && p < n_in;
            off = off + u32(max(p, 0)) * mult;
            mult = mult * u32(n_in);
        }
        if (inside) {
            for (var ci = 0u; ci < cg; ci = ci + 1u) {
                acc = acc + x_in[x_base + ci * in_size + off] * w_in[w_base + ci * taps + t];
            }
        }
    }
{{BIAS}}
    out[idx] = acc;
}
