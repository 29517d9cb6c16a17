// The adapter's f32 FLOP/s roof (engine/runtime/peaks.py): every thread runs ITERATIONS
// rounds of 16 independent vec4 fused multiply-adds (128 FLOPs a round) held in
// registers, then writes their sum so that nothing is optimised away. The count comes
// from a uniform, so the compiler cannot fold the loop.

struct Params { iterations: u32, pad0: u32, pad1: u32, pad2: u32 }

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> sink: array<vec4<f32>>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = gid.x + gid.y * nwg.x * 256u;
    let s = f32(t & 1023u) * 1e-6;
    let m = vec4<f32>(0.9999, 0.9998, 0.9997, 0.9996);
    let c = vec4<f32>(1e-4, 2e-4, 3e-4, 4e-4);
    var a0 = vec4<f32>(s, s + 0.1, s + 0.2, s + 0.3);
    var a1 = a0 + 1.0;
    var a2 = a0 + 2.0;
    var a3 = a0 + 3.0;
    var a4 = a0 + 4.0;
    var a5 = a0 + 5.0;
    var a6 = a0 + 6.0;
    var a7 = a0 + 7.0;
    for (var i = 0u; i < params.iterations; i = i + 1u) {
        a0 = fma(a0, m, c); a1 = fma(a1, m, c); a2 = fma(a2, m, c); a3 = fma(a3, m, c);
        a4 = fma(a4, m, c); a5 = fma(a5, m, c); a6 = fma(a6, m, c); a7 = fma(a7, m, c);
        a0 = fma(a0, m, c); a1 = fma(a1, m, c); a2 = fma(a2, m, c); a3 = fma(a3, m, c);
        a4 = fma(a4, m, c); a5 = fma(a5, m, c); a6 = fma(a6, m, c); a7 = fma(a7, m, c);
    }
    sink[t] = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
}
