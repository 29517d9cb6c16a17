// Sum of squares of one gradient into stats[slot]: one workgroup, a tree reduction.
// The optimizer kernels add the slots up into the global norm for clipping.
// meta: [n, slot]

{{PRELUDE}}

@group(0) @binding(1) var<storage, read> grad: array<f32>;
@group(0) @binding(2) var<storage, read_write> stats: array<f32>;

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid: vec3<u32>) {
    let t = lid.x;
    var s = 0.0;
    for (var i = t; i < m(0u); i = i + 256u) { let v = grad[i]; s = s + v * v; }
    red[t] = s;
    workgroupBarrier();
    for (var k = 128u; k > 0u; k = k >> 1u) {
        if (t < k) { red[t] = red[t] + red[t + k]; }
        workgroupBarrier();
    }
    if (t == 0u) { stats[m(1u)] = red[0]; }
}
