// Rotate-half RoPE of element i of a head of d values at position pos, from its pair:
// x1 = element i mod d/2 of the head, x2 = element i mod d/2 + d/2. The inverse
// frequencies are meta words freq0 .. freq0 + d/2 - 1 (computed in float64 on the host);
// inverse rotates back (the gradient).
fn rope_(x1: f32, x2: f32, i: u32, d: u32, pos: u32, freq0: u32, inverse: bool) -> f32 {
    let half = d / 2u;
    let ang = f32(pos) * mf(freq0 + i % half);
    let c = cos(ang);
    let s = select(sin(ang), -sin(ang), inverse);
    return select(x2 * c + x1 * s, x1 * c - x2 * s, i < half);
}
