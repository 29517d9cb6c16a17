// How the cooperative attention kernels scale an operand block into f16's range: a power
// of two from the block's largest magnitude (its threads' amax4, met through subgroupMax
// and workgroup memory), exact to undo.
fn amax4(x: vec4<f32>) -> f32 {
    let a = abs(x);
    return max(max(a.x, a.y), max(a.z, a.w));
}

// e such that 2^(14 - e) puts a largest magnitude `top` in [2^14, 2^15) (0 for 0).
fn exponent_of(top: f32) -> f32 {
    return clamp(select(0.0, floor(log2(top)), top > 0.0), -100.0, 100.0);
}

// The largest of the 4 subgroups' values red[at..at + 3] (the kernel's workgroup array `red`).
fn red_top(at: u32) -> f32 {
    return max(max(red[at], red[at + 1u]), max(red[at + 2u], red[at + 3u]));
}
