// Element e (a vec4 of 4 consecutive values of a row, D4 vec4s a row) rounded to f16 into
// the workgroup tile(s) {{TILES}}, row-major with rows of KS halves: how the cooperative
// attention kernels stage their operands (split products: the hi part, then the lo part).
fn put_{{NAME}}(e: u32, x: vec4<f32>) {
    let at = e / D4 * KS + e % D4 * 4u;
{{PARTS}}
}
