// Gradient-norm partial sums: workgroup w adds the squares of one CHUNK of the
// gradient into stats[first + w], so a large gradient spreads over many workgroups.
// norm_total.wgsl then adds every partial into stats[1] for the optimizer kernels.
// meta: [n, first]

{{PRELUDE}}

@group(0) @binding(1) var<storage, read> grad: array<f32>;
@group(0) @binding(2) var<storage, read_write> stats: array<f32>;

const CHUNK: u32 = {{CHUNK}}u;

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = lid.x;
    let w = wg.y * nwg.x + wg.x;
    let end = min(m(0u), (w + 1u) * CHUNK);
    var s = 0.0;
    for (var i = w * CHUNK + t; i < end; i = i + 256u) { let v = grad[i]; s = s + v * v; }
    red[t] = s;
    workgroupBarrier();
    for (var k = 128u; k > 0u; k = k >> 1u) {
        if (t < k) { red[t] = red[t] + red[t + k]; }
        workgroupBarrier();
    }
    if (t == 0u && w * CHUNK < m(0u)) { stats[m(1u) + w] = red[0]; }
}
