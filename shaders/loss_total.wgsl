// Second stage of a loss: partials holds a pair (sum, count) per row or chunk of the
// first stage (reduce_row.wgsl); out[0] = the sum of the sums over the sum of the counts,
// the count at least 1 (a batch whose labels are all ignored has loss 0). One workgroup.
// meta: [pairs]

{{PRELUDE}}

{{BINDINGS}}

const WG_THREADS: u32 = 256u;

{{WG_REDUCE}}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid: vec3<u32>{{SG_ARGS}}) {
{{SG_INIT}}
    let t = lid.x;
    var s = 0.0;
    var c = 0.0;
    for (var i = t; i < m(0u); i = i + 256u) { s = s + partials[2u * i]; c = c + partials[2u * i + 1u]; }
    s = wg_sum(s, t);
    c = wg_sum(c, t);
    if (t == 0u) { out[0] = s / max(c, 1.0); }
}
