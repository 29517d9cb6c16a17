// Gradient of max_pool, gathered (no atomics): one thread per input element sums dout
// over the windows whose first maximum (row-major over the kernel; a NaN is a maximum,
// the first one wins; taps outside the input are -inf) is this element.
// meta: [total, taps, in_size, out_size, out[ND], in[ND], kernel[ND], stride[ND],
//        pad_begin[ND], dilation[ND]]

{{PRELUDE}}

{{BINDINGS}}

const ND: u32 = {{ND}}u;

fn g(field: u32, d: u32) -> u32 { return m(4u + field * ND + d); }
fn grad_is_nan_(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }

// The flat input offset of window ``win`` (flat over out[ND]) at tap ``t``, or -1 outside.
fn tap_offset(win: u32, t: u32) -> i32 {
    var rw = win;
    var rt = t;
    var off = 0u;
    var mult = 1u;
    for (var d = i32(ND) - 1; d >= 0; d = d - 1) {
        let ud = u32(d);
        let e = g(0u, ud);
        let pd = rw % e;
        rw = rw / e;
        let k = g(2u, ud);
        let kd = rt % k;
        rt = rt / k;
        let qd = i32(pd * g(3u, ud) + kd * g(5u, ud)) - i32(g(4u, ud));
        let n_in = i32(g(1u, ud));
        if (qd < 0 || qd >= n_in) { return -1; }
        off = off + u32(qd) * mult;
        mult = mult * u32(n_in);
    }
    return i32(off);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    let taps = m(1u);
    let in_size = m(2u);
    let out_size = m(3u);
    let plane = idx / in_size;           // n * C + c
    let here = i32(idx % in_size);
    var q: array<u32, ND>;
    var rem = idx % in_size;
    for (var d = i32(ND) - 1; d >= 0; d = d - 1) {
        let e = g(1u, u32(d));
        q[d] = rem % e;
        rem = rem / e;
    }
    var acc = 0.0;
    for (var t = 0u; t < taps; t = t + 1u) {
        // the window that reads this element at tap t, if there is one
        var rt = t;
        var win = 0u;
        var mult = 1u;
        var hit = true;
        for (var d = i32(ND) - 1; d >= 0; d = d - 1) {
            let ud = u32(d);
            let k = g(2u, ud);
            let kd = rt % k;
            rt = rt / k;
            let num = i32(q[d] + g(4u, ud)) - i32(kd * g(5u, ud));
            let s = i32(g(3u, ud));
            let p = num / s;
            hit = hit && num >= 0 && num % s == 0 && u32(p) < g(0u, ud);
            win = win + u32(max(p, 0)) * mult;
            mult = mult * g(0u, ud);
        }
        if (!hit) { continue; }
        var best = -inf_();
        var best_off = -2;
        for (var u = 0u; u < taps; u = u + 1u) {
            let off = tap_offset(win, u);
            var v = -inf_();
            if (off >= 0) { v = in1[plane * in_size + u32(off)]; }
            if (u == 0u || (!grad_is_nan_(best) && (grad_is_nan_(v) || v > best))) {
                best = v;
                best_off = off;
            }
        }
        if (best_off == here) { acc = acc + in0[plane * out_size + win]; }
    }
    out[idx] = acc;
}
