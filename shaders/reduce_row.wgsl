// Row-reduction archetype: one workgroup of 256 threads per row of N elements
// (rows of the last axis, or the whole tensor as one row), a tree reduction in
// workgroup memory, then an epilogue that writes one value per row (sum, mean, max)
// or the whole row again (softmax, log_softmax, layer_norm, rms_norm).
// meta: [rows, N, eps]

{{PRELUDE}}

{{BINDINGS}}

var<workgroup> red: array<f32, 256>;

fn wg_sum(v: f32, t: u32) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (t < s) { red[t] = red[t] + red[t + s]; }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn wg_max(v: f32, t: u32) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (t < s) { red[t] = max(red[t], red[t + s]); }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wg.y * nwg.x + wg.x;
    let rows = m(0u);
    let N = m(1u);
    let eps = mf(2u);
    let t = lid.x;
    if (row >= rows) { return; }
    let base = row * N;
{{MODE}}
}
