// Pointwise archetype: one thread per output element of a fused elementwise DAG.
// meta: [total, out_shape[RANK], strides of operand 0[RANK], ..., program constants]
// Operands broadcast numpy-style through their strides (0 on broadcast axes).

{{PRELUDE}}

{{BINDINGS}}

const RANK: u32 = {{RANK}}u;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
{{OFFSETS}}
{{LOADS}}
{{BODY}}
    out[idx] = {{RESULT}};
}
