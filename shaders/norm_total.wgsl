// stats[1] = the global gradient norm, from the partials (m, sum of (g / m)^2) of
// sum_squares.wgsl at stats[2 ..]: with M the largest m, norm = M * sqrt(sum of
// s * (m / M)^2), in range whatever the gradients' size. One workgroup; clipping reads
// the norm, and so does the host.
// meta: [partials]

{{PRELUDE}}

@group(0) @binding(1) var<storage, read_write> stats: array<f32>;

const WG_THREADS: u32 = 256u;

{{WG_REDUCE}}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid: vec3<u32>{{SG_ARGS}}) {
{{SG_INIT}}
    let t = lid.x;
    let count = m(0u);
    var big = 0.0;
    for (var i = t; i < count; i = i + 256u) { big = max(big, stats[2u + 2u * i]); }
    big = wg_max(big, t);
    var s = 0.0;
    if (big > 0.0 && is_finite_(big)) {
        for (var i = t; i < count; i = i + 256u) {
            let r = stats[2u + 2u * i] / big;
            s = s + stats[3u + 2u * i] * r * r;
        }
    }
    s = wg_sum(s, t);
    if (t == 0u) { stats[1] = select(big * sqrt(s), big, !is_finite_(big)); }
}
