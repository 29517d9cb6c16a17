// Scalar-loss archetype: one workgroup of 256 threads walks every row (cross_entropy:
// one row of C logits per thread at a time) or every element (mse_loss), then a tree
// reduction in workgroup memory writes the mean into out[0].
// meta: [rows, C or total, ignore_index]

{{PRELUDE}}

{{BINDINGS}}

var<workgroup> red: array<f32, 256>;

fn wg_sum(v: f32, t: u32) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (t < s) { red[t] = red[t] + red[t + s]; }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid: vec3<u32>) {
    let t = lid.x;
{{MODE}}
}
