// Gradients of the direct N-d convolution (conv_general), gathered (no atomics), one
// thread per element of the gradient (window arithmetic: window.wgsl):
// - INPUT (conv_general_input_grad; in0 = dout, in1 = w): dx[n, c, q] sums
//   dout[n, o, p] * w[o, c - g * CG, k] over the outputs o of c's group g and the taps k
//   whose output position p reads q;
// - WEIGHT (conv_general_weight_grad; in0 = x, in1 = dout): dw[o, ci, k] sums
//   dout[n, o, p] * x[n, g * CG + ci, what p reads at tap k] over n and p, zero in the padding.
// meta: [total, O, CG, OG, C, N, taps, in_size, out_size, then the window fields from
//        word 9: out, in, kernel, stride, pad_begin, dilation]

{{PRELUDE}}

{{BINDINGS}}

const ND: u32 = {{ND}}u;
const INPUT: bool = {{INPUT}};

{{WINDOW}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    let n_out = m(1u);
    let cg = m(2u);
    let og = m(3u);
    let c_all = m(4u);
    let taps = m(6u);
    let in_size = m(7u);
    let out_size = m(8u);
    var acc = 0.0;
    if (INPUT) {
        var q: array<u32, ND>;
        let rem = unravel_(idx, 1u, &q);     // n * C + c
        let c = rem % c_all;
        let n = rem / c_all;
        let grp = c / cg;
        let ci = c % cg;
        for (var t = 0u; t < taps; t = t + 1u) {
            let at = source_(&q, t);
            if (at >= 0) {
                for (var j = 0u; j < og; j = j + 1u) {
                    let o = grp * og + j;
                    acc = acc + in0[(n * n_out + o) * out_size + u32(at)] * in1[(o * cg + ci) * taps + t];
                }
            }
        }
    } else {
        let t = idx % taps;
        let ci = (idx / taps) % cg;
        let o = idx / (taps * cg);
        let c = (o / og) * cg + ci;
        var pos: array<u32, ND>;
        for (var n = 0u; n < m(5u); n = n + 1u) {
            for (var p = 0u; p < out_size; p = p + 1u) {
                unravel_(p, 0u, &pos);
                let off = tap_(&pos, t);
                if (off >= 0) {
                    acc = acc + in1[(n * n_out + o) * out_size + p] * in0[(n * c_all + c) * in_size + u32(off)];
                }
            }
        }
    }
    out[idx] = acc;
}
