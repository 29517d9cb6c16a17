// Pooling archetype (max_pool / avg_pool), N-d over the axes after [N, C]: one thread per
// output element walks its window. A tap at output position o, kernel offset k reads
// input position o * stride + k * dilation - pad_begin; taps outside the input are the
// padding (-inf for max, left out of the sum for avg). The average divides by the taps
// inside the input, or with INCLUDE_PAD by those inside the declared padding too (not the
// extra right padding of ceil_mode).
// meta: [total, taps, in_size, out[ND], in[ND], kernel[ND], stride[ND], pad_begin[ND],
//        pad_end[ND], dilation[ND]]

{{PRELUDE}}

{{BINDINGS}}

const ND: u32 = {{ND}}u;
const MAX_MODE: bool = {{MAX_MODE}};
const INCLUDE_PAD: bool = {{INCLUDE_PAD}};

fn g(field: u32, d: u32) -> u32 { return m(3u + field * ND + d); }
fn pool_is_nan_(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }

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
    let base = rem * m(2u);          // rem = n * C + c
    var acc = select(0.0, -inf_(), MAX_MODE);
    var count = 0.0;
    for (var t = 0u; t < m(1u); t = t + 1u) {
        var r = t;
        var off = 0u;
        var mult = 1u;
        var inside = true;
        var declared = true;
        for (var d = i32(ND) - 1; d >= 0; d = d - 1) {
            let ud = u32(d);
            let k = g(2u, ud);
            let kd = r % k;
            r = r / k;
            let p = i32(pos[d] * g(3u, ud) + kd * g(6u, ud)) - i32(g(4u, ud));
            let n_in = i32(g(1u, ud));
            inside = inside && p >= 0 && p < n_in;
            declared = declared && p < n_in + i32(g(5u, ud));
            off = off + u32(max(p, 0)) * mult;
            mult = mult * u32(n_in);
        }
        if (inside) {
            let v = in0[base + off];
            if (MAX_MODE) {
                if (!pool_is_nan_(acc) && (pool_is_nan_(v) || v > acc)) { acc = v; }
            } else {
                acc = acc + v;
            }
            count = count + 1.0;
        } else if (INCLUDE_PAD && declared) {
            count = count + 1.0;
        }
    }
    out[idx] = select(acc / count, acc, MAX_MODE);
}
