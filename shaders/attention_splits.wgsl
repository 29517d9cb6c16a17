// Attention archetype, second stage of a split kernel. When an attention kernel's grid
// (blocks of 32 rows x heads x batch) is too small to fill the GPU, codegen splits the
// streamed side (keys for the forward, lse and dq; queries for dk and dv) into `splits`
// parts, each a workgroup of its own writing a partial result into `partials`; this kernel
// combines them into out, one thread per output element:
//   MODE_SOFTMAX (forward): partials hold each part's unnormalised O rows (a vec4 of
//     columns), then per part and 4 queries a vec4 of row maxima (log2 units) and one of
//     row sums; O = sum_p 2^(m_p - M) O_p / sum_p 2^(m_p - M) l_p, M = max_p m_p.
//   MODE_SUM (dq, dk, dv): out = sum_p partials[p * N + i].
//   MODE_LOGSUMEXP (lse): out = M + log sum_p exp(L_p - M); a part that saw no key holds -inf.
// STORE_LSE (attention_stats: the forward keeps its softmax's statistics for the backward):
// MODE_SOFTMAX also writes each row's log-sum-exp, (M + log2 sum_p 2^(m_p - M) l_p) ln 2, at
// element LSE_AT + (b T + t) H + h of out (codegen's _store_lse).
// meta: [N, splits, B, T, H, D4, TQ = ceil(T / 4)]; grid: ceil(N / 256), folded.

{{PRELUDE}}

{{BINDINGS}}

const MODE_SOFTMAX: u32 = 0u;
const MODE_SUM: u32 = 1u;
const MODE_LOGSUMEXP: u32 = 2u;
const MODE: u32 = {{MODE}}u;
const NEG: f32 = -1.0e30;

// The row maximum (which = 0) or sum (which = 1) that part p found for query t of (b, h).
fn row_stat(p: u32, b: u32, h: u32, t: u32, which: u32) -> f32 {
    let n4 = m(0u);
    let base = m(1u) * n4;
    let at = base + (((p * m(2u) + b) * m(4u) + h) * m(6u) + t / 4u) * 2u + which;
    return {{STAT}};
}

fn combine(i: u32) -> {{OUT_TYPE}} {
    let n = m(0u);
    let splits = m(1u);
    if (MODE == MODE_SUM) {
        var s = partials[i];
        for (var p = 1u; p < splits; p = p + 1u) { s = s + partials[p * n + i]; }
        return s;
    }
    if (MODE == MODE_LOGSUMEXP) {
        var top = partials[i];
        for (var p = 1u; p < splits; p = p + 1u) { top = max(top, partials[p * n + i]); }
        var s = {{ZERO}};
        for (var p = 0u; p < splits; p = p + 1u) { s = s + exp(partials[p * n + i] - top); }
        return top + log(s);
    }
    let r = i / m(5u);          // (b * T + t) * H + h
    let h = r % m(4u);
    let t = (r / m(4u)) % m(3u);
    let b = r / (m(4u) * m(3u));
    var top = NEG;
    for (var p = 0u; p < splits; p = p + 1u) { top = max(top, row_stat(p, b, h, t, 0u)); }
    var num = {{ZERO}};
    var den = 0.0;
    for (var p = 0u; p < splits; p = p + 1u) {
        let w = exp2(row_stat(p, b, h, t, 0u) - top);
        den = den + w * row_stat(p, b, h, t, 1u);
        num = num + w * partials[p * n + i];
    }
    return select({{ZERO}}, num / den, den > 0.0);
}

// Row r's log-sum-exp (natural log) from the parts' maxima and sums.
fn row_lse(r: u32) -> f32 {
    let h = r % m(4u);
    let t = (r / m(4u)) % m(3u);
    let b = r / (m(4u) * m(3u));
    var top = NEG;
    for (var p = 0u; p < m(1u); p = p + 1u) { top = max(top, row_stat(p, b, h, t, 0u)); }
    var den = 0.0;
    for (var p = 0u; p < m(1u); p = p + 1u) { den = den + exp2(row_stat(p, b, h, t, 0u) - top) * row_stat(p, b, h, t, 1u); }
    return (top + log2(den)) * 0.6931471805599453;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wg, nwg, lid, 256u);
    if (i < m(0u)) { out[i] = combine(i); }
{{STORE_LSE}}
}
