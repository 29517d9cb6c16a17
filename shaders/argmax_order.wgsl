// The order argmax picks by: ties go to the lower index and a NaN beats any number, as
// numpy's argmax has it; an index of 0xffffffff is no element (so a row of -inf still
// picks its first). Shared by argmax.wgsl and the products that leave it their
// workgroups' best (codegen's product_with_argmax).
fn is_nan(v: f32) -> bool { return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u; }

// Whether (v, i) comes before (bv, bi).
fn better(v: f32, i: u32, bv: f32, bi: u32) -> bool {
    if (i == 0xffffffffu || bi == 0xffffffffu) { return bi == 0xffffffffu && i != bi; }
    if (is_nan(v)) { return !is_nan(bv) || i < bi; }
    if (is_nan(bv)) { return false; }
    return v > bv || (v == bv && i < bi);
}
