// Attention archetype, backward on cooperative matrices (flash attention 2 with f16 operands
// on the tensor cores, f32 accumulation; attention_backward.wgsl's math, its f32 kernels the
// fallback). Two kernels (MODE):
//   dq:   fixed queries (A = Q, B = dO), streamed keys (X = K, Y = V):   dq_i = scale sum_j dS_ij k_j
//   dkdv: fixed keys (A = K, B = V), streamed queries of every head of the kv group
//         (X = Q, Y = dO):                  dk_j = scale sum_i dS_ij q_i, dv_j = sum_i P_ij dO_i
// with s = scale q.k, P = exp(s - L), dP = dO v^T, dS = P (dP - Delta) (L, Delta: inputs).
// One workgroup of 4 subgroups (128 threads, subgroups of 32) owns BF = 64 fixed rows of one
// head (subgroup sg rows f0 + 16 sg .. + 15), staged once as f16 (A's 64 rows through Xh
// and Yh, then B's) and kept as D / 16 left fragments each. Per streamed block of BS = 32
// rows (64 where the grid is small: codegen's backward_streamed), X and Y are staged as f16
// (row-major, rows padded by PAD halves); then each subgroup:
//   S [16 x BS] = A X^T -> its f32 scratch Sc -> its lanes: p = exp2(S scale log2(e) - L)
//   (lane: row lane % 16, the streamed rows of parity lane / 16 in the forward's rotated order);
//   dkdv: P (f16) -> its Ph, dV += P Y on its result fragments dvf;
//   dP = B Y^T -> Sc -> lanes: ds = p (dP / sY - Delta) in f32, times a power of two s2 that
//   puts the subgroup's largest |ds| in [2^14, 2^15), rounded to f16 into Ph;
//   G += dS X on its result fragments gf.
// dO is a gradient: before it is rounded it is scaled by the power of two sY that puts its
// largest |value| in [2^14, 2^15) (dq: over the workgroup's 64 rows, once; dkdv: over each
// block); dP is divided by sY in f32. Powers of two are exact to undo, so any magnitude of
// dO keeps f16's relative precision. q, k, v are activations, rounded without a scan.
// f32 on cooperative matrices (SPLIT, codegen's split_products): every operand (A, B, X, Y,
// P, dS) is staged as hi and lo f16 parts (Xl, Yl, Pl beside Xh, Yh, Ph) and each product
// is three (hi lo + lo hi + hi hi, as the split matmul's). All four operands are scaled:
// A and B once, X and Y each block (dq's Y, V, by its own block's power of two; dkdv's, dO,
// only ever lowered, as below); S and dP are multiplied back in f32, and the result
// fragments of dS X hold their sums times s2 times X's scale, kept only ever lowered.
// The result fragments hold their sums times the scale of the last block; a block whose
// scale is lower first multiplies them by the ratio (a power of two: exact). Scales are only
// ever lowered (a block of smaller values is rounded at the sum's scale), so no ratio
// exceeds 1 and no sum can overflow; at the end the fragments are divided by their scale.
// Causal (key j visible to query i iff j <= i): dq stops after the block of its last query,
// dkdv starts its queries at its first key; scores past the diagonal, T or S give p = 0.
// A block's X and Y (dkdv: and its queries' L and Delta) are fetched into registers before
// the barrier that frees the tiles (L and Delta fetched after it cost dkdv 11%; the next
// block's X fetched during this one's products, held through them, 10% too: run 32).
// Blocks of 32 streamed rows keep the workgroup's memory under 24 KiB, so that two
// workgroups share an SM (on the H100 one of 28 KiB or more has it alone: run 37); split
// products take blocks of 16 for that (their fixed rows staged in two rounds).
// In blocks of 64 the fixed rows of A, then of B, fit Xh whole.
// No splits of the streamed side (the f32 kernels have them).
// q, dout: [B, T, H*D]; k, v: [B, S, HKV*D] (D % 16 == 0, D <= 64); lse, delta: [B, T, H].
// out: dq [B, T, H*D], or dk and dv [B, S, HKV*D] each, dv from element dv_at.
// dkdv with a scores binding (codegen's scores_pair) also writes each block's dS, as Ph holds
// it (times s2), and s2 there, for attention_coop_dq.wgsl's product (meta word 8: where the
// scales begin); SPLIT: Pl's lo parts too, from halfway to the scales.
// meta: [T, S, H, HKV, causal, scale * log2(e), scale, dv_at(, scales_at)]; grid: (ceil(fixed / BF), heads, B)

{{PRELUDE}}

{{BINDINGS}}
{{SCORES_BINDING}}

const MODE_DQ: u32 = 0u;
const MODE_DKDV: u32 = 1u;
const MODE: u32 = {{MODE}}u;
const D: u32 = {{D}}u;
const D4: u32 = D / 4u;
const BF: u32 = 64u;
const BS: u32 = {{BS}}u;
const KS: u32 = D + {{PAD}}u;       // halves a row of Xh, Yh
const PS: u32 = BS + {{PAD}}u;      // halves a row of a subgroup's Ph
const SS: u32 = {{SS}}u;          // floats a row of a subgroup's Sc
const LOG2E: f32 = 1.4426950408889634;
const SPLIT: bool = {{SPLIT}};   // f32 operands as hi and lo f16 parts, three products each

var<workgroup> Xh: array<f16, BS * KS>;     // the block's X; first the fixed A
var<workgroup> Yh: array<f16, BS * KS>;     // the block's Y (dkdv: dO * sY); first the fixed B (dq: dO * sY)
var<workgroup> Ph: array<f16, 4u * 16u * PS>;
var<workgroup> Sc: array<f32, 4u * 16u * SS>;
var<workgroup> Ls: array<f32, BS>;          // dkdv: the block's queries' L (log2 units) and Delta
var<workgroup> Ds: array<f32, BS>;
var<workgroup> red: array<f32, {{RED}}>;          // the subgroups' largest |dO| (split: |B| or |Y|, then |A| or |X|)
{{SPLIT_DECLS}}

// Element e (a vec4) of rows r0.. of operand `which` (0 q, 1 k, 2 v, 3 dout; [B, n, heads * D],
// head hx), row-major; rows past n are zero. Neighbouring threads read a row's neighbouring vec4s.
fn fetch_rows(e: u32, b: u32, hx: u32, r0: u32, n: u32, heads: u32, which: u32) -> vec4<f32> {
    let j = e / D4;
    if (r0 + j >= n) { return vec4<f32>(0.0); }
    let at = ((b * n + r0 + j) * heads + hx) * D4 + e % D4;
    switch which {
        case 0u: { return q[at]; }
        case 1u: { return k[at]; }
        case 2u: { return v[at]; }
        default: { return dout[at]; }
    }
}

{{TILE_SCALES}}

{{PUT_TILES}}

// The scales the result fragments are multiplied by are uniform across each subgroup (its
// subgroupMax, or red's), which is what the hardware needs; Tint's analysis proves only
// workgroup uniformity, hence the diagnostic.
{{ENTRY}}
    let sl2 = mf(5u);
    let scale = mf(6u);
    let group = H / HKV;
    let head = wg.y;                // dq: a query head; dkdv: a kv head
    let b = wg.z;
    let f0 = wg.x * BF;
    let r = lane % 16u;
    let half = lane / 16u;
    let fr = f0 + 16u * sg + r;     // this lane's fixed row
    let sb = sg * 16u * SS;
    let pb = sg * 16u * PS;
    let dq = MODE == MODE_DQ;
    let NF = select(S, T, dq);      // fixed rows and heads
    let HF = select(HKV, H, dq);
    let NS = select(T, S, dq);      // streamed rows and heads
    let HS = select(H, HKV, dq);
    // the streamed rows lo..hi - 1 this lane's row sees
    var lo = 0u;
    var hi = S;
    var begin = 0u;                 // the workgroup's streamed rows begin..end of each of `heads` heads
    var end = S;
    var heads = 1u;
    var row_lse = 0.0;
    var row_delta = 0.0;
    if (dq) {
        if (causal) {
            hi = min(S, fr + 1u);
            end = min(S, f0 + BF);
        }
        if (fr < T) {
            let i = (b * T + fr) * H + head;
            row_lse = lse[i] * LOG2E;
            row_delta = delta[i];
        } else {
            hi = 0u;
        }
    } else {
        hi = select(0u, T, fr < S);
        end = T;
        heads = group;
        if (causal) {
            lo = fr;
            begin = min(f0, T);
        }
    }
{{FETCH_FIXED}}
    var top_y = 0.0;
{{FIXED_MAX}}
    { let top = subgroupMax(top_y); if (lane == 0u) { red[sg] = top; } }
    workgroupBarrier();
    let ex_fixed = exponent_of(red_top(0u));
    let s_fixed = select(1.0, exp2(14.0 - ex_fixed), dq || SPLIT);
{{PUT_FIXED}}
    workgroupBarrier();
{{LOAD_FIXED}}
{{RESULTS}}
    var s_g = exp2(114.0);          // the scale gf holds (dq or dk), then dvf's (dkdv): only ever lowered
    var s_v = exp2(114.0);
    let blocks = (end - begin + BS - 1u) / BS;
    for (var it = 0u; it < heads * blocks; it = it + 1u) {
        let c0 = begin + it % blocks * BS;
        let sh = select(head * group + it / blocks, head / group, dq);   // the streamed head
{{FETCH_STREAM}}
        var l = 0.0;                // dkdv: thread tid's streamed query's L and Delta, fetched with X and Y
        var dl = 0.0;
        if (!dq && tid < BS && c0 + tid < T) {
            let i = (b * T + c0 + tid) * H + sh;
            l = lse[i] * LOG2E;
            dl = delta[i];
        }
        top_y = 0.0;
{{STREAM_MAX}}
        workgroupBarrier();         // the previous block's tiles, Sc, Ls, Ds and red are read
        var s_y = 1.0;              // dkdv: this block's dO scale
        var inv_y = 1.0 / s_fixed;  // what undoes dO's scale in dP
        var ratio_y = 1.0;          // dkdv: what brings dvf to s_y
        if (!dq) {
            s_y = min(s_v, exp2(14.0 - exponent_of(red_top(0u))));
            inv_y = 1.0 / s_y;
            ratio_y = s_y / s_v;
            s_v = s_y;
        }
{{STREAM_SCALES}}
{{PUT_STREAM}}
        if (!dq && tid < BS) {
            Ls[tid] = l;
            Ds[tid] = dl;
        }
        workgroupBarrier();
{{SCORES}}
        workgroupBarrier();
        var p: array<f32, {{LANE_ROWS}}>;      // row r, streamed rows c0 + 2 ((c + r) % {{LANE_ROWS}}) + half
{{PROBABILITIES}}
{{PV}}
{{DP}}
        workgroupBarrier();
        var top = 0.0;
{{DS}}
{{DS_SCALE}}
{{PUT_DS}}
        workgroupBarrier();
{{GRAD}}
{{SCORES_OUT}}
    }
    workgroupBarrier();             // the last block's Sc is read
{{STORE}}
}
