// Gradients of the direct N-d convolution (conv_general), gathered (no atomics), one
// thread per element of the gradient:
// - INPUT (conv_general_input_grad): dx[n, c, q] sums dout[n, o, p] * w[o, c - g * CG, k]
//   over the outputs o of c's group g and the taps with p * stride + k * dilation -
//   pad_begin = q (p a whole output position);
// - WEIGHT (conv_general_weight_grad): dw[o, ci, k] sums dout[n, o, p] * x[n, g * CG + ci,
//   p * stride + k * dilation - pad_begin] over n and p, zero outside the input.
// meta: [total, O, CG, OG, C, N, taps, in_size, out_size, in[ND], out[ND], kernel[ND],
//        stride[ND], pad_begin[ND], dilation[ND]]

{{PRELUDE}}

{{BINDINGS}}

const ND: u32 = {{ND}}u;
const INPUT: bool = {{INPUT}};

fn g(field: u32, d: u32) -> u32 { return m(9u + field * ND + d); }

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
        // idx = ((n * C + c) * in_size + q)
        var q: array<u32, ND>;
        var rem = idx;
        for (var d = i32(ND) - 1; d >= 0; d = d - 1) {
            let e = g(0u, u32(d));
            q[d] = rem % e;
            rem = rem / e;
        }
        let c = rem % c_all;
        let n = rem / c_all;
        let grp = c / cg;
        let ci = c % cg;
        for (var t = 0u; t < taps; t = t + 1u) {
            var r = t;
            var off = 0u;
            var mult = 1u;
            var hit = true;
            for (var d = i32(ND) - 1; d >= 0; d = d - 1) {
                let ud = u32(d);
                let k = g(2u, ud);
                let kd = r % k;
                r = r / k;
                let num = i32(q[d] + g(4u, ud)) - i32(kd * g(5u, ud));
                let s = i32(g(3u, ud));
                let p = num / s;
                hit = hit && num >= 0 && num % s == 0 && u32(p) < g(1u, ud);
                off = off + u32(max(p, 0)) * mult;
                mult = mult * g(1u, ud);
            }
            if (hit) {
                for (var j = 0u; j < og; j = j + 1u) {
                    let o = grp * og + j;
                    acc = acc + in0[(n * n_out + o) * out_size + off] * in1[(o * cg + ci) * taps + t];
                }
            }
        }
    } else {
        // idx = ((o * CG + ci) * taps + t); in0 = x, in1 = dout
        let t = idx % taps;
        let ci = (idx / taps) % cg;
        let o = idx / (taps * cg);
        let c = (o / og) * cg + ci;
        for (var n = 0u; n < m(5u); n = n + 1u) {
            for (var p = 0u; p < out_size; p = p + 1u) {
                var rp = p;
                var rk = t;
                var off = 0u;
                var mult = 1u;
                var inside = true;
                for (var d = i32(ND) - 1; d >= 0; d = d - 1) {
                    let ud = u32(d);
                    let e = g(1u, ud);
                    let pd = rp % e;
                    rp = rp / e;
                    let k = g(2u, ud);
                    let kd = rk % k;
                    rk = rk / k;
                    let qd = i32(pd * g(3u, ud) + kd * g(5u, ud)) - i32(g(4u, ud));
                    let n_in = i32(g(0u, ud));
                    inside = inside && qd >= 0 && qd < n_in;
                    off = off + u32(max(qd, 0)) * mult;
                    mult = mult * u32(n_in);
                }
                if (inside) {
                    acc = acc + in1[(n * n_out + o) * out_size + p] * in0[(n * c_all + c) * in_size + off];
                }
            }
        }
    }
    out[idx] = acc;
}
