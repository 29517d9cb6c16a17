// The adapter's memory bandwidth roof (engine/runtime/peaks.py): a grid-stride copy of
// one buffer into another, 16 bytes per thread per round; bytes moved = 2 x the size.

@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<vec4<f32>>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let n = arrayLength(&src);
    let stride = nwg.x * 256u;
    for (var i = gid.x; i < n; i = i + stride) {
        dst[i] = src[i];
    }
}
