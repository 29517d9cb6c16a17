// The cooperative attention kernels' entry point (attention_coop*.wgsl's {{ENTRY}}): a
// workgroup of subgroups of 32 and the meta words they all begin with, [T, S, H, HKV, causal].
@compute @workgroup_size({{THREADS}}) @diagnostic(off, chromium.subgroup_matrix_uniformity)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32,
        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {
    let T = m(0u);
    let S = m(1u);
    let H = m(2u);
    let HKV = m(3u);
    let causal = m(4u) != 0u;
