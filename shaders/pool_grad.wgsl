// Gradient of max_pool, gathered (no atomics): one thread per input element sums dout
// over the windows whose first maximum (row-major over the kernel; a NaN is a maximum,
// the first one wins; taps outside the input are -inf) is this element.
// meta: [total, taps, in_size, out_size, then the window fields from word 4: out, in,
//        kernel, stride, pad_begin, dilation]

{{PRELUDE}}

{{BINDINGS}}

const ND: u32 = {{ND}}u;

{{WINDOW}}

fn grad_is_nan_(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    let taps = m(1u);
    let in_size = m(2u);
    let plane = idx / in_size;           // n * C + c
    let here = i32(idx % in_size);
    var q: array<u32, ND>;
    unravel_(idx % in_size, 1u, &q);
    var acc = 0.0;
    for (var t = 0u; t < taps; t = t + 1u) {
        let win = source_(&q, t);        // the window that reads this element at tap t
        if (win < 0) { continue; }
        var wpos: array<u32, ND>;
        unravel_(u32(win), 0u, &wpos);
        var best = -inf_();
        var best_off = -2;
        for (var u = 0u; u < taps; u = u + 1u) {
            let off = tap_(&wpos, u);
            var v = -inf_();
            if (off >= 0) { v = in1[plane * in_size + u32(off)]; }
            if (u == 0u || (!grad_is_nan_(best) && (grad_is_nan_(v) || v > best))) {
                best = v;
                best_off = off;
            }
        }
        if (best_off == here) { acc = acc + in0[plane * m(3u) + u32(win)]; }
    }
    out[idx] = acc;
}
