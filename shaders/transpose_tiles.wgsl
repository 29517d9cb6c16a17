// Copy archetype: a transpose of the last two axes ([batches, R, C] -> [batches, C, R])
// through a 32 x 32 tile of workgroup memory, so that a warp reads 32 consecutive elements
// of an input row and writes 32 consecutive elements of an output row (the generic copy
// writes in order but reads with a stride of C, and divides its index by each extent).
// One workgroup of 32 x 8 threads per tile and batch element; tile rows are padded by one
// element against bank conflicts. meta: [R, C]; grid: (ceil(C / 32), ceil(R / 32), batches)

{{PRELUDE}}

{{BINDINGS}}

var<workgroup> tile: array<{{T}}, 1056>;   // 32 rows of 33

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let R = m(0u);
    let C = m(1u);
    let x = tid % 32u;
    let y = tid / 32u;
    let r0 = wg.y * 32u;
    let c0 = wg.x * 32u;
    let base = wg.z * R * C;
    for (var j = y; j < 32u; j = j + 8u) {
        if (r0 + j < R && c0 + x < C) { tile[j * 33u + x] = in0[base + (r0 + j) * C + c0 + x]; }
    }
    workgroupBarrier();
    for (var j = y; j < 32u; j = j + 8u) {
        if (c0 + j < C && r0 + x < R) { out[base + (c0 + j) * R + r0 + x] = tile[x * 33u + j]; }
    }
}
