// Row-reduction archetype: one workgroup of WG_THREADS threads per row of N elements
// (rows of the last axis, or the whole tensor as one row; 64 threads for rows of a few
// hundred, up to 256 for long ones), a tree reduction in workgroup memory, then an epilogue that writes one value per row (sum, mean, max)
// or the whole row again (softmax, log_softmax, layer_norm, rms_norm).
// meta: [rows, N, eps]

{{PRELUDE}}

{{BINDINGS}}

const WG_THREADS: u32 = {{THREADS}}u;

{{WG_REDUCE}}

@compute @workgroup_size({{THREADS}})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>{{SG_ARGS}}) {
{{SG_INIT}}
    let row = wg.y * nwg.x + wg.x;
    let rows = m(0u);
    let N = m(1u);
    let eps = mf(2u);
    let t = lid.x;
    if (row >= rows) { return; }
    let base = row * N;
{{MODE}}
}
