// Copy archetype: a weight stored as bf16 (two elements to a u32 word, the first in the
// lower half) widened to f32 for a kernel that reads f32 only; a word a thread.
// meta: [elements]

{{PRELUDE}}

{{BINDINGS}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let w = flat_index(wg, nwg, lid, 256u);
    let i = 2u * w;
    if (i >= m(0u)) { return; }
    let word = in0[w];
    out[i] = bf16_(word, 0u);
    if (i + 1u < m(0u)) { out[i + 1u] = bf16_(word, 1u); }
}
