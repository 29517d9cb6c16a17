// Attention archetype, plain path: one thread per (batch, head, query) streams over the
// keys with an online softmax (running max and sum, accumulator rescaled), so no score
// matrix is ever stored. Grouped-query: head h reads key/value head h / (H / HKV).
// q, out: [B, T, H*D]; k, v: [B, S, HKV*D].
// meta: [total, T, S, H, HKV, causal, scale]
// The per-key dot product and update are unrolled over D by codegen: llvmpipe (lavapipe)
// stops a shader invocation after ~65535 loop iterations in total, which nested loops
// over D hit at a few hundred keys; unrolled, only the key loop counts.

{{PRELUDE}}

{{BINDINGS}}

const D: u32 = {{D}}u;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 64u);
    if (idx >= m(0u)) { return; }
    let T = m(1u); let S = m(2u); let H = m(3u); let HKV = m(4u);
    let causal = m(5u) != 0u;
    let scale = mf(6u);
    let t = idx % T;
    let h = (idx / T) % H;
    let b = idx / (T * H);
    let hk = h / (H / HKV);
    let qb = (b * T + t) * H * D + h * D;
    var qv: array<f32, D>;
    var acc: array<f32, D>;
    for (var i = 0u; i < D; i = i + 1u) { qv[i] = q[qb + i] * scale; acc[i] = 0.0; }
    var mx = -3.4028234e38;
    var l = 0.0;
    var end = S;
    if (causal) { end = min(S, t + 1u); }
    for (var s = 0u; s < end; s = s + 1u) {
        let kb = (b * S + s) * HKV * D + hk * D;
        let score = {{SCORE}};
        let mn = max(mx, score);
        let corr = exp(mx - mn);
        let p = exp(score - mn);
        l = l * corr + p;
{{ACCUMULATE}}
        mx = mn;
    }
    let inv = 1.0 / l;
    for (var i = 0u; i < D; i = i + 1u) { out[qb + i] = acc[i] * inv; }
}
