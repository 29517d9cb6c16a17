// The 16 partials (one per thread column tx, at {{PARTIALS}}[tx * {{STRIDE}} + ty]) of a
// thread's 4 rows, combined: shared by the attention kernels' row maxima and sums.
fn rows_max(ty: u32) -> vec4<f32> {
    var r = {{PARTIALS}}[ty];
    for (var j = 1u; j < 16u; j = j + 1u) { r = max(r, {{PARTIALS}}[j * {{STRIDE}} + ty]); }
    return r;
}

fn rows_sum(ty: u32) -> vec4<f32> {
    var r = {{PARTIALS}}[ty];
    for (var j = 1u; j < 16u; j = j + 1u) { r = r + {{PARTIALS}}[j * {{STRIDE}} + ty]; }
    return r;
}
