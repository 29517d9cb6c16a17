// The index of each row's largest element (a decode step's greedy token): one workgroup of
// 256 threads a row; each thread keeps the best (value, index) of its elements, loaded
// 8 at a time so that their loads overlap (a row of 49,152 logits is 24 rounds, not 192),
// then a tree in workgroup memory. Ties go to the lower index and a NaN beats any number,
// as numpy's argmax has it. out is i32.
// meta: [rows, N]

{{PRELUDE}}

{{BINDINGS}}

var<workgroup> best_v: array<f32, 256>;
var<workgroup> best_i: array<u32, 256>;

fn is_nan(v: f32) -> bool { return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u; }

// Whether (v, i) comes before (bv, bi); an index of 0xffffffff is no element (so a row
// of -inf still picks its first).
fn better(v: f32, i: u32, bv: f32, bi: u32) -> bool {
    if (i == 0xffffffffu || bi == 0xffffffffu) { return bi == 0xffffffffu && i != bi; }
    if (is_nan(v)) { return !is_nan(bv) || i < bi; }
    if (is_nan(bv)) { return false; }
    return v > bv || (v == bv && i < bi);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wg.y * nwg.x + wg.x;
    let N = m(1u);
    let t = lid.x;
    if (row >= m(0u)) { return; }
    let base = row * N;
    var bv = 0.0;
    var bi = 0xffffffffu;
    var i = t;
    for (; i + 1792u < N; i = i + 2048u) {
        var v: array<f32, 8>;
        for (var k = 0u; k < 8u; k = k + 1u) { v[k] = x[base + i + 256u * k]; }
        for (var k = 0u; k < 8u; k = k + 1u) {
            if (better(v[k], i + 256u * k, bv, bi)) { bv = v[k]; bi = i + 256u * k; }
        }
    }
    for (; i < N; i = i + 256u) {
        let v = x[base + i];
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    best_v[t] = bv;
    best_i[t] = bi;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (t < s && better(best_v[t + s], best_i[t + s], best_v[t], best_i[t])) {
            best_v[t] = best_v[t + s];
            best_i[t] = best_i[t + s];
        }
        workgroupBarrier();
    }
    if (t == 0u) { out[row] = i32(best_i[0]); }
}
