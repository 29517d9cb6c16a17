// Element e (a vec4 of 4 consecutive values of a row, D4 vec4s a row) rounded to f16 into
// the workgroup tile {{TILE}}, row-major with rows of KS halves: how the cooperative
// attention kernels stage their operands.
fn put_{{NAME}}(e: u32, x: vec4<f32>) {
    let at = e / D4 * KS + e % D4 * 4u;
    let h = vec4<f16>(x);
    {{TILE}}[at] = h.x; {{TILE}}[at + 1u] = h.y; {{TILE}}[at + 2u] = h.z; {{TILE}}[at + 3u] = h.w;
}
