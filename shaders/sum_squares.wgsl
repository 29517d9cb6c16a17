// Gradient-norm partials: workgroup w takes one CHUNK of the gradient and leaves two
// numbers in stats[first + 2w ..]: the largest |g| of the chunk, m, and the sum of
// (g / m)^2. Scaling by m keeps the squares in range: a gradient element of 1e21 (seen
// on audio-align's first step) has a square past f32's 3.4e38, so a plain sum of squares
// would give an infinite norm and skip every step. A non-finite element makes m infinite,
// so the norm is too and the step is skipped. norm_total.wgsl combines the partials.
// meta: [n, first]

{{PRELUDE}}

@group(0) @binding(1) var<storage, read> grad: array<f32>;
@group(0) @binding(2) var<storage, read_write> stats: array<f32>;

const CHUNK: u32 = {{CHUNK}}u;

const WG_THREADS: u32 = 256u;

{{WG_REDUCE}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>{{SG_ARGS}}) {
{{SG_INIT}}
    let t = lid.x;
    let w = wg.y * nwg.x + wg.x;
    let start = w * CHUNK;
    let end = min(m(0u), start + CHUNK);
    var mx = 0.0;
    var bad = 0.0;
    for (var i = start + t; i < end; i = i + 256u) {
        let v = abs(grad[i]);
        if (is_finite_(v)) { mx = max(mx, v); } else { bad = 1.0; }
    }
    mx = wg_max(mx, t);
    bad = wg_max(bad, t);
    var s = 0.0;
    if (mx > 0.0) {
        for (var i = start + t; i < end; i = i + 256u) { let r = grad[i] / mx; s = s + r * r; }
    }
    s = wg_sum(s, t);
    if (t == 0u && start < m(0u)) {
        stats[m(1u) + 2u * w] = select(mx, inf_(), bad > 0.0);
        stats[m(1u) + 2u * w + 1u] = s;
    }
}
