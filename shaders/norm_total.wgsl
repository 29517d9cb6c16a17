// stats[1] = sum of the gradient-norm partials stats[2 .. 2 + count]: the squared
// global gradient norm that clipping and the host read. One workgroup.
// meta: [count]

{{PRELUDE}}

@group(0) @binding(1) var<storage, read_write> stats: array<f32>;

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid: vec3<u32>) {
    let t = lid.x;
    var s = 0.0;
    for (var i = t; i < m(0u); i = i + 256u) { s = s + stats[2u + i]; }
    red[t] = s;
    workgroupBarrier();
    for (var k = 128u; k > 0u; k = k >> 1u) {
        if (t < k) { red[t] = red[t] + red[t + k]; }
        workgroupBarrier();
    }
    if (t == 0u) { stats[1] = red[0]; }
}
