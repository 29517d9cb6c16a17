// Attention archetype: attention_grad_q as a product, dq_i = scale sum_j dS_ij k_j, of the dS
// that attention_grad_kv's cooperative kernel wrote beside dk and dv (its "scores" binding:
// codegen's scores_layout), instead of a kernel that computes the scores, P and dP again.
// The scores hold dS^T as f16 pairs, a row of 64-query blocks a key, times a power of two
// s per 16 keys and QG queries (the dkdv subgroup's scale); each QG-query block takes the
// least s over the keys it reads as its common scale c, and every staged element is
// multiplied by c / s (a power of two, at most 1: exact unless it falls below f16's range,
// where it is negligible beside the block's largest value near 2^15).
// One workgroup of BQ / 16 subgroups owns BQ queries of one head (subgroup sg rows
// q0 + 16 sg .. + 15) and streams the keys in blocks of BK: K (f16, row-major) and dS^T
// (a row a key, as the scores hold it) are staged, each subgroup multiplies its 16 columns
// of dS^T (a column-major left fragment: 30 us a layer faster at whisper-tiny's batch 8
// than dS transposed as it is staged, run 42) by K on D / 16 result fragments; at the
// end those are scaled by scale / c and leave through a scratch, a fragment at a time.
// K and dS are fetched into registers blocks ahead (codegen writes the loop: tuning.dq_prefetch).
// Each key group's factor c / s for each query block is worked out once, before the blocks,
// into fs where the key groups are few enough (codegen's FACTORS slots), else read with each
// staged element (whisper-tiny's at batch 8 on the H100: 262 us a layer read so, 228 staged
// once; run 44).
// Causal: keys past the workgroup's last query are skipped; dkdv wrote zeros for those
// past a query inside the blocks it reads.
// f32 on cooperative matrices (codegen's split_products): dkdv wrote dS's hi parts and,
// after them, its lo parts; each staged element is their sum times its factor, split
// again into Sh and Sl, K is staged as hi and lo parts (Kh, Kl) and each product is three.
// Each key block's K is scaled by a power of two: the workgroup's scale s_k is only ever
// lowered (the result fragments multiplied by the ratio) and divided out at the end.
// k: [B, S, HKV*D]; out: dq [B, T, H*D].
// meta: [T, S, H, HKV, causal, scale, the scales' first vec4]; grid: (ceil(T / BQ), H, B)

{{PRELUDE}}

{{BINDINGS}}

const D: u32 = {{D}}u;
const D4: u32 = D / 4u;
const BQ: u32 = {{BQ}}u;            // queries a workgroup: 16 a subgroup
const BK: u32 = {{BK}}u;            // keys a block
const SUBGROUPS: u32 = BQ / 16u;
const KS: u32 = D + {{PAD}}u;       // halves a row of Kh
const QS: u32 = BQ + {{PAD}}u;      // halves a row of Sh
const QG: u32 = {{QG}}u;            // queries a dS scale covers (dkdv's blocks: 32, split products 16)
const QB: u32 = BQ / QG;            // query blocks of a common scale
const FACTORS: u32 = {{FACTORS}}u;  // slots of fs (0: the factors are read as elements are staged)

var<workgroup> Kh: array<f16, BK * KS>;
var<workgroup> Sh: array<f16, BK * QS>;    // the block's dS^T: a row a key, the workgroup's queries
var<workgroup> Sc: array<f32, {{SCRATCH}}u>;   // fragments on their way out
var<workgroup> cs: array<f32, SUBGROUPS>;  // the common scale of each subgroup's 32-query block
{{FACTORS_TILE}}
{{SPLIT_DECLS}}

{{PUT_TILES}}

// Nothing before the products branches on the lane (the fetches below select instead):
// lanes that took another way there left parts of each fragment unwritten (the H100
// through Dawn).

// Element e (a vec4) of keys k0.. of kv head hk, row-major; keys past S are zero.
fn fetch_k(e: u32, b: u32, hk: u32, k0: u32, S: u32, HKV: u32) -> vec4<f32> {
    let ok = k0 + e / D4 < S;
    return select(vec4<f32>(0.0), k[((b * S + select(0u, k0 + e / D4, ok)) * HKV + hk) * D4 + e % D4], ok);
}

// Element e (8 queries' halves; BQ / 8 a key) of keys k0.. of dS^T row block bh, in the
// scores from vec4 `first` on (split products: 0 for the hi parts, then the lo parts');
// zeros past S (and anything past T: factor_s is 0 there).
fn fetch_s(e: u32, bh: u32, k0: u32, q0: u32, T: u32, S: u32, first: u32) -> vec4<u32> {
    let ok = k0 + e / (BQ / 8u) < S;
    let row = (T + 63u) / 64u * 8u;
    let at = (bh * S + select(0u, k0 + e / (BQ / 8u), ok)) * row + min(q0 / 8u + e % (BQ / 8u), row - 1u);
    return select(vec4<u32>(0u), scores[first + at], ok);
}

// The scale dkdv gave key group g's dS for query block qb of this workgroup's (clamped in range).
fn scale_of(bh: u32, g: u32, qb: u32, q0: u32, T: u32, S: u32, ex: u32) -> f32 {
    let blocks = (T + 63u) / 64u * (64u / QG);
    return bitcast<f32>(scores[ex + (bh * ((S + 15u) / 16u) + min(g, (S + 15u) / 16u - 1u)) * blocks
                               + min(q0 / QG + qb, blocks - 1u)].x);
}

// What brings element e of fetch_s to its query block's common scale: c / s (0 past S or T).
fn factor_s(e: u32, bh: u32, k0: u32, q0: u32, T: u32, S: u32, ex: u32) -> f32 {
    let qb = e % (BQ / 8u) / (QG / 8u);
    let ok = k0 + e / (BQ / 8u) < S && q0 + qb * QG < T;
    let key = select(0u, k0 + e / (BQ / 8u), ok);
{{FACTOR}}
}

{{PUT_S}}

{{ENTRY}}
    let scale = mf(5u);
    let ex = m(6u);
    let h = wg.y;
    let b = wg.z;
    let hk = h / (H / HKV);
    let bh = b * H + h;
    let q0 = wg.x * BQ;
    let end = select(S, min(S, q0 + BQ), causal);
    {   // the common scale of this subgroup's query block: the least over the keys read
        let qb = sg / (QG / 16u);
        let groups = (end + 15u) / 16u;
        var c = 3.0e38;
        for (var k0 = 0u; k0 < groups; k0 = k0 + 32u) {   // no branch on the lane: see fetch_k
            let kg = k0 + lane;
            c = min(c, select(3.0e38, scale_of(bh, kg, qb, q0, T, S, ex), kg < groups && q0 + qb * QG < T));
        }
        cs[sg] = subgroupMin(c);    // every lane: the same value
    }
    workgroupBarrier();
{{FACTORS_PUT}}
{{RESULTS}}
    let blocks = (end + BK - 1u) / BK;
{{LOOP}}
    let factor = scale / cs[sg]{{K_UNSCALE}};
{{STORE}}
}
