// Scalar-loss archetype: one workgroup of 256 threads walks every row (cross_entropy:
// one row of C logits per thread at a time) or every element (mse_loss), then a tree
// reduction in workgroup memory writes the mean into out[0].
// meta: [rows, C or total, ignore_index]

{{PRELUDE}}

{{BINDINGS}}

{{WG_REDUCE}}

{{HELPERS}}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid: vec3<u32>{{SG_ARGS}}) {
{{SG_INIT}}
    let t = lid.x;
{{MODE}}
}
