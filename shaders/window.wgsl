// Window arithmetic shared by the direct convolution, pooling and their gradients, over
// the ND axes after [N, C]. Geometry in meta, ND words a field from word WINDOW_BASE:
// 0 out, 1 in, 2 kernel, 3 stride, 4 pad_begin, 5 dilation (6 pad_end where a kernel has
// it). A tap at output position p, kernel offset k reads input position
// p * stride + k * dilation - pad_begin.

fn g(field: u32, d: u32) -> u32 { return m({{WINDOW_BASE}}u + field * ND + d); }

// Positions of `idx` over the shape in `field` (row-major, last axis fastest) into `pos`;
// returns what is left of idx (the index over the leading axes).
fn unravel_(idx: u32, field: u32, pos: ptr<function, array<u32, ND>>) -> u32 {
    var rem = idx;
    for (var d = i32(ND) - 1; d >= 0; d = d - 1) {
        let n = g(field, u32(d));
        (*pos)[d] = rem % n;
        rem = rem / n;
    }
    return rem;
}

// The input coordinates, axis by axis, that output position `pos` reads at tap `t`
// (negative or past the input in the padding).
fn tap_coords_(pos: ptr<function, array<u32, ND>>, t: u32, at: ptr<function, array<i32, ND>>) {
    var r = t;
    for (var d = i32(ND) - 1; d >= 0; d = d - 1) {
        let ud = u32(d);
        let k = g(2u, ud);
        let kd = r % k;
        r = r / k;
        (*at)[d] = i32((*pos)[d] * g(3u, ud) + kd * g(5u, ud)) - i32(g(4u, ud));
    }
}

// The flat input offset that output position `pos` reads at tap `t`, or -1 in the padding.
fn tap_(pos: ptr<function, array<u32, ND>>, t: u32) -> i32 {
    var at: array<i32, ND>;
    tap_coords_(pos, t, &at);
    var off = 0u;
    var mult = 1u;
    for (var d = i32(ND) - 1; d >= 0; d = d - 1) {
        let n_in = i32(g(1u, u32(d)));
        if (at[d] < 0 || at[d] >= n_in) { return -1; }
        off = off + u32(at[d]) * mult;
        mult = mult * u32(n_in);
    }
    return i32(off);
}

// The flat output position whose tap `t` reads input position `q`, or -1 when none does
// (a stride that steps over q, or a position past the output).
fn source_(q: ptr<function, array<u32, ND>>, t: u32) -> i32 {
    var r = t;
    var at = 0u;
    var mult = 1u;
    for (var d = i32(ND) - 1; d >= 0; d = d - 1) {
        let ud = u32(d);
        let k = g(2u, ud);
        let kd = r % k;
        r = r / k;
        let num = i32((*q)[d] + g(4u, ud)) - i32(kd * g(5u, ud));
        let s = i32(g(3u, ud));
        if (num < 0 || num % s != 0 || u32(num / s) >= g(0u, ud)) { return -1; }
        at = at + u32(num / s) * mult;
        mult = mult * g(0u, ud);
    }
    return i32(at);
}
