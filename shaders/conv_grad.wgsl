// Convolution gradients (direct, 1-d as 2-d with height 1), one thread per element of
// the gradient being produced, so no atomics and a deterministic sum order:
//   input:  dx[n, c, y, x]  = sum over o, ky, kx of dout[n, o, oy, ox] * w[o, c, ky, kx]
//           where y = oy*SH + ky - PH (only offsets that land on the stride grid count);
//   weight: dw[o, c, ky, kx] = sum over n, oy, ox of dout[n, o, oy, ox] * x[n, c, y, x].
// meta: [total, N, C, O, H, W, KH, KW, OH, OW, SH, SW, PH, PW]

{{PRELUDE}}

{{BINDINGS}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    let N = m(1u); let C = m(2u); let O = m(3u); let H = m(4u); let W = m(5u);
    let KH = m(6u); let KW = m(7u); let OH = m(8u); let OW = m(9u);
    let SH = m(10u); let SW = m(11u); let PH = m(12u); let PW = m(13u);
    var acc = 0.0;
{{MODE}}
    out[idx] = acc;
}
