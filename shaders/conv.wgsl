// Convolution archetype (direct, 1-d as 2-d with height 1): one thread per output
// element of [N, O, OH, OW] sums over C x KH x KW, zero padding by bounds checks.
// meta: [total, C, O, H, W, KH, KW, OH, OW, SH, SW, PH, PW]

{{PRELUDE}}

{{BINDINGS}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    let C = m(1u); let O = m(2u); let H = m(3u); let W = m(4u);
    let KH = m(5u); let KW = m(6u); let OH = m(7u); let OW = m(8u);
    let ox = idx % OW;
    let oy = (idx / OW) % OH;
    let o = (idx / (OW * OH)) % O;
    let n = idx / (OW * OH * O);
    var acc = 0.0;
    for (var c = 0u; c < C; c = c + 1u) {
        for (var ky = 0u; ky < KH; ky = ky + 1u) {
            let iy = i32(oy * m(9u) + ky) - i32(m(11u));
            if (iy < 0 || iy >= i32(H)) { continue; }
            for (var kx = 0u; kx < KW; kx = kx + 1u) {
                let ix = i32(ox * m(10u) + kx) - i32(m(12u));
                if (ix < 0 || ix >= i32(W)) { continue; }
                acc = acc + x[((n * C + c) * H + u32(iy)) * W + u32(ix)] * w[((o * C + c) * KH + ky) * KW + kx];
            }
        }
    }
    out[idx] = acc{{BIAS}};
}
