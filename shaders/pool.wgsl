// Pooling archetype (max_pool / avg_pool): one thread per output element walks its
// window (window.wgsl); taps outside the input are the padding (-inf for max, left out
// of the sum for avg). The average divides by the taps inside the input, or with
// INCLUDE_PAD by those inside the declared padding too (not the extra right padding of
// ceil_mode).
// meta: [total, taps, in_size, then the window fields from word 3: out, in, kernel,
//        stride, pad_begin, dilation, pad_end]

{{PRELUDE}}

{{BINDINGS}}

const ND: u32 = {{ND}}u;
const MAX_MODE: bool = {{MAX_MODE}};
const INCLUDE_PAD: bool = {{INCLUDE_PAD}};

{{WINDOW}}

fn pool_is_nan_(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }

// Whether tap t of output position pos lies inside the input or its declared padding.
fn declared_(pos: ptr<function, array<u32, ND>>, t: u32) -> bool {
    var at: array<i32, ND>;
    tap_coords_(pos, t, &at);
    for (var d = 0u; d < ND; d = d + 1u) {
        if (at[d] >= i32(g(1u, d) + g(6u, d))) { return false; }
    }
    return true;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    var pos: array<u32, ND>;
    let base = unravel_(idx, 0u, &pos) * m(2u);      // (n * C + c) * in_size
    var acc = select(0.0, -inf_(), MAX_MODE);
    var count = 0.0;
    for (var t = 0u; t < m(1u); t = t + 1u) {
        let off = tap_(&pos, t);
        if (off >= 0) {
            let v = in0[base + u32(off)];
            if (MAX_MODE) {
                if (!pool_is_nan_(acc) && (pool_is_nan_(v) || v > acc)) { acc = v; }
            } else {
                acc = acc + v;
            }
            count = count + 1.0;
        } else if (INCLUDE_PAD && declared_(&pos, t)) {
            count = count + 1.0;
        }
    }
    out[idx] = select(acc / count, acc, MAX_MODE);
}
