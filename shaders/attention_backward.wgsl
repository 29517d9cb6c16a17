// Attention archetype, backward (flash attention 2, f32) and the row statistics it needs.
// One template, three kernels (MODE). A workgroup of 4 R threads owns R "fixed" rows of one
// head and streams the other side through workgroup memory, C = 64 rows at a time,
// recomputing the scores s = scale q.k (masked) instead of reading a T x S matrix:
//   lse: fixed queries, streamed keys:                  L_i = log sum_j exp(s_ij)
//   dq:  fixed queries (Q, dO), streamed keys (K, V):   dq_i = scale sum_j dS_ij k_j
//   dkdv: fixed keys (K, V), streamed queries (Q, dO):  dk_j = scale sum_i dS_ij q_i, dv_j = sum_i P_ij dO_i
// with P = exp(s - L), dP_ij = dO_i . v_j, dS = P (dP - Delta) and Delta_i = dO_i . O_i (an
// input). dkdv streams the queries of every head of its kv group (grouped-query), so
// every output element belongs to one workgroup: no atomics.
// Roles: A and B are the fixed operands of the scores and of dP, staged once (As, Bs: d-major,
// a vec4 = 4 rows; A times scale * log2(e) so the softmax runs on exp2). X and Y are the
// streamed ones, staged one after the other into Ss (d-major, a vec4 = 4 streamed rows, d-rows
// of C / 4 + 1 vec4s: the score loop reads along a d-row, the accumulation down a column, and
// neither conflicts on banks). Ps holds the block's P or dS (a vec4 = 4 fixed rows, padded rows).
// Why 4 x 4 tiles (scores: 4 fixed x 4 streamed rows; outputs: 4 fixed rows x 4 columns): a
// 4 x 4 tile reads 0.5 floats of workgroup memory a multiply-add (4 x 2: 0.75). What bounds
// these kernels is staging the streamed blocks: each serves R fixed rows, so R is as large as
// the workgroup memory allows.
// Per block: dq, dkdv stage Y, compute dP, stage X, compute the scores and dS into Ps, then
// accumulate dS X with X still staged; dkdv then puts P into Ps and Y into Ss again for P Y,
// a second accumulator: one pass of scores and dP serves both dk and dv (H100, whisper-tiny
// at batch 8: 3.40 ms a layer, against 2.83 + 2.27 for a dk and a dv kernel). X (and dkdv's
// Y, kept for its second staging) is fetched into registers at the block's start;
// lse keeps a running max and sum of exp2 per row and thread, combined across threads at the end.
// Thread (tx < 16, ty), a warp 8 x 4 of them (THREAD_XY: codegen's thread layouts): ty owns
// fixed rows 4ty..4ty+3; tx scores streamed rows 4tx..4tx+3 and accumulates output columns
// tx + 16 r, r < ceil(D / 16).
// Causal (key j visible to query i iff j <= i): lse and dq stop after the block of their last
// query, dkdv starts at its first key; scores past the diagonal, T or S count 0.
// The loops over d, over a block's rows and the staging are unrolled by codegen: llvmpipe
// (lavapipe) ends an invocation after ~65535 loop iterations in total; one is left per block.
// Workgroup memory at D = 64, R = 32: As 8192 + Bs 8192 (dq, dkdv; 16 lse) + Ss 17408 +
// Ps 9216 (lse: 16 rows, 2304) = 43,008 bytes (NVIDIA offers 48 KiB); R is 64, 32 or 16, the
// most the device holds (attention_backward_rows() in codegen): NVIDIA at D = 64 takes 64 for
// lse, 32 for the others; lavapipe's 32 KiB 32 for lse, 16 for the others.
// q, dout: [B, T, H*D] and k, v: [B, S, HKV*D], read as vec4 (D % 4 == 0, D <= 64); lse, delta:
// [B, T, H]. out: lse [B, T, H], dq [B, T, H*D], dk and dv [B, S, HKV*D] each, dv at element
// dv_at (packed: attention_grad_kv_layout).
// Split: when that grid is too small to fill the GPU, each workgroup's streamed blocks are
// shared among `splits` workgroups, part p writing its partial output at p * N (N = the
// output's elements) for attention_splits.wgsl to add up (lse: to take their logsumexp).
// meta: [T, S, H, HKV, causal, scale * log2(e), scale, splits, N, dv_at]; grid:
// (ceil(fixed rows / R), heads of the fixed side, B * splits)

{{PRELUDE}}

{{BINDINGS}}

const MODE_LSE: u32 = 0u;
const MODE_DQ: u32 = 1u;
const MODE_DKDV: u32 = 2u;
const MODE: u32 = {{MODE}}u;
const ROWS_ARE_QUERIES: bool = MODE == MODE_LSE || MODE == MODE_DQ;
const HAS_DP: bool = MODE != MODE_LSE;
const ROLE_A: u32 = 0u;
const ROLE_B: u32 = 1u;
const ROLE_X: u32 = 2u;
const ROLE_Y: u32 = 3u;

const D: u32 = {{D}}u;
const D4: u32 = D / 4u;
const R: u32 = {{R}}u;
const C: u32 = 64u;
const THREADS: u32 = 4u * R;
const RV: u32 = R / 4u;      // vec4s in a d-row of As, Bs
const PR: u32 = RV + 1u;     // padded row of Ps
const CV: u32 = C / 4u + 1u; // padded d-row of Ss (vec4s)
const NEG: f32 = -1.0e30;    // finite "no score yet": exp2(NEG - NEG) stays a number
const LOG2E: f32 = 1.4426950408889634;
const LN2: f32 = 0.6931471805599453;

var<workgroup> As: array<vec4<f32>, D * RV>;
var<workgroup> Bs: array<vec4<f32>, {{BS_LEN}}>;
var<workgroup> Ss: array<vec4<f32>, {{SS_ROWS}}u * CV>;
var<workgroup> Ps: array<vec4<f32>, {{PS_ROWS}} * PR>;   // a block's P or dS; lse: its 16 partials

// L (in log2 units) and Delta of statistics row i; 0 where this kernel has no such input.
fn lse2_at(i: u32) -> f32 { return {{LSE_AT}}; }
fn delta_at(i: u32) -> f32 { return {{DELTA_AT}}; }

// (L, Delta) of query `query` of head `head`; zero past T.
fn stats_of(b: u32, query: u32, head: u32) -> vec2<f32> {
    if (query >= m(0u)) { return vec2<f32>(0.0); }
    let i = (b * m(0u) + query) * m(2u) + head;
    return vec2<f32>(lse2_at(i), delta_at(i));
}

// Dims 4 d4 .. 4 d4 + 3 of row `row` of head `head` of the operand playing `role`; zero past
// the operand's rows. A and B are on the fixed side, X and Y on the streamed side.
fn operand_row(role: u32, b: u32, row: u32, head: u32, d4: u32) -> vec4<f32> {
    let queries = (role < ROLE_X) == ROWS_ARE_QUERIES;
    let n = select(m(1u), m(0u), queries);
    if (row >= n) { return vec4<f32>(0.0); }
    let at = ((b * n + row) * select(m(3u), m(2u), queries) + head) * D4 + d4;
    switch role {
        case 0u: { return {{A}}[at]; }
        case 1u: { return {{B}}[at]; }
        case 2u: { return {{X}}[at]; }
        default: { return {{Y}}[at]; }
    }
}

// x = dims 4 d4 .. 4 d4 + 3 of fixed row i into the d-major As (or Bs).
fn put_fixed(to_b: bool, d4: u32, i: u32, x: vec4<f32>) {
    let at = d4 * 4u * RV + i / 4u;
    let c = i % 4u;
    if (to_b) {
        Bs[at][c] = x.x; Bs[at + RV][c] = x.y; Bs[at + 2u * RV][c] = x.z; Bs[at + 3u * RV][c] = x.w;
    } else {
        As[at][c] = x.x; As[at + RV][c] = x.y; As[at + 2u * RV][c] = x.z; As[at + 3u * RV][c] = x.w;
    }
}

// Fixed rows r0.. of head `head`: A (times scale * log2(e)) and, for dq and dkdv, B.
fn stage_fixed(tid: u32, b: u32, head: u32, r0: u32) {
    let scale = mf(5u);
    for (var e = tid; e < R * D4; e = e + THREADS) {
        let i = e / D4;   // neighbouring threads read neighbouring vec4s of a row
        let d4 = e % D4;
        put_fixed(false, d4, i, operand_row(ROLE_A, b, r0 + i, head, d4) * scale);
        if (HAS_DP) { put_fixed(true, d4, i, operand_row(ROLE_B, b, r0 + i, head, d4)); }
    }
}

// Element e (a vec4 of a row) of streamed rows c0.. of X or Y, fetched, then put into Ss:
// 16 neighbouring threads take 16 rows (their stores land in 16 neighbouring floats), and
// the next 16 the next vec4 of those rows, so a warp reads 32 contiguous bytes (a sector)
// of each of 16 rows and, Ss's d-rows padded by a vec4, its transposing stores hit 32
// distinct banks (8 rows x 4 vec4s hit 16 banks twice; vec4s of one row one thread apart
// would store with 16-way bank conflicts into the d-major Ss).
fn element_row(e: u32) -> u32 { return e / (16u * D4) * 16u + e % 16u; }
fn element_d4(e: u32) -> u32 { return e / 16u % D4; }

fn fetch_element(role: u32, e: u32, b: u32, head: u32, c0: u32) -> vec4<f32> {
    if (e >= C * D4) { return vec4<f32>(0.0); }
    return operand_row(role, b, c0 + element_row(e), head, element_d4(e));
}

fn put_element(e: u32, x: vec4<f32>) {
    if (e >= C * D4) { return; }
    let j = element_row(e);
    let at = 4u * element_d4(e) * CV + j / 4u;
    let c = j % 4u;
    Ss[at][c] = x.x; Ss[at + CV][c] = x.y; Ss[at + 2u * CV][c] = x.z; Ss[at + 3u * CV][c] = x.w;
}

fn stage_element(role: u32, e: u32, b: u32, head: u32, c0: u32) {
    put_element(e, fetch_element(role, e, b, head, c0));
}

fn stage_stream(role: u32, tid: u32, b: u32, head: u32, c0: u32) {
{{STAGE}}
}

// Scores of 4 fixed rows (a vec4) against streamed rows 4tx..4tx+3 (x), one d at a time.
fn score_step(s: mat4x4<f32>, a: vec4<f32>, x: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(fma(a, vec4<f32>(x.x), s[0]), fma(a, vec4<f32>(x.y), s[1]),
                       fma(a, vec4<f32>(x.z), s[2]), fma(a, vec4<f32>(x.w), s[3]));
}

// Column r of o (4 fixed rows at output column tx + 16 r) += p (4 fixed rows) * x[r].
fn accumulate_step(o: mat4x4<f32>, p: vec4<f32>, x: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(fma(p, vec4<f32>(x.x), o[0]), fma(p, vec4<f32>(x.y), o[1]),
                       fma(p, vec4<f32>(x.z), o[2]), fma(p, vec4<f32>(x.w), o[3]));
}

fn masked(s: vec4<f32>, seen: vec4<bool>) -> vec4<f32> { return select(vec4<f32>(NEG), s, seen); }

// exp2(s - lse) where the score counts, else 0 (P, or the lse pass's share of the row sum).
fn weight(s: vec4<f32>, lse: vec4<f32>, seen: vec4<bool>) -> vec4<f32> {
    return select(vec4<f32>(0.0), exp2(s - lse), seen);
}

// Whether the scores of fixed rows `rows` against streamed row `col` count.
fn visible(rows: vec4<u32>, col: u32, causal: bool) -> vec4<bool> {
    let query = select(vec4<u32>(col), rows, ROWS_ARE_QUERIES);
    let key = select(rows, vec4<u32>(col), ROWS_ARE_QUERIES);
    let inside = (query < vec4<u32>(m(0u))) & (key < vec4<u32>(m(1u)));
    return inside & select(vec4<bool>(true), key <= query, causal);
}

// Output row `row` of the fixed side, columns tx + 16 r from x[r], into out from element `base`.
fn store_row(base: u32, b: u32, head: u32, row: u32, tx: u32, x: vec4<f32>) {
    let n = select(m(1u), m(0u), ROWS_ARE_QUERIES);
    if (row >= n) { return; }
    let at = base + ((b * n + row) * select(m(3u), m(2u), ROWS_ARE_QUERIES) + head) * D + tx;
    if (tx < D) { out[at] = x.x; }
    if (tx + 16u < D) { out[at + 16u] = x.y; }
    if (tx + 32u < D) { out[at + 32u] = x.z; }
    if (tx + 48u < D) { out[at + 48u] = x.w; }
}

fn store_lse(part: u32, b: u32, head: u32, row: u32, l: f32) {
    if (row < m(0u)) { out[part * m(8u) + (b * m(0u) + row) * m(2u) + head] = l; }
}

{{ROWS}}

@compute @workgroup_size({{THREADS}})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let T = m(0u);
    let S = m(1u);
    let group = m(2u) / m(3u);
    let causal = m(4u) != 0u;
    let splits = m(7u);
    let head = wg.y;        // of the fixed rows: a query head (lse, dq) or a kv head (dkdv)
    let b = wg.z / splits;
    let part = wg.z % splits;
    let r0 = wg.x * R;
{{THREAD_XY}}
    let rows = vec4<u32>(r0 + 4u * ty) + vec4<u32>(0u, 1u, 2u, 3u);
    var begin = 0u;         // streamed rows begin..end of each of `heads` streamed heads
    var end = S;
    var heads = 1u;
    if (ROWS_ARE_QUERIES) {
        if (causal) { end = min(S, r0 + R); }
    } else {
        end = T;
        heads = group;
        if (causal) { begin = min(r0, T); }
    }
    let blocks = (end - begin + C - 1u) / C;
    stage_fixed(tid, b, head, r0);
    let st0 = stats_of(b, rows.x, head);   // dq: its rows' L and Delta
    let st1 = stats_of(b, rows.y, head);
    let st2 = stats_of(b, rows.z, head);
    let st3 = stats_of(b, rows.w, head);
    let row_lse = vec4<f32>(st0.x, st1.x, st2.x, st3.x);
    let row_delta = vec4<f32>(st0.y, st1.y, st2.y, st3.y);
    var o = mat4x4<f32>();      // dq, dk
    var ov = mat4x4<f32>();     // dv
    var mx = vec4<f32>(NEG);    // lse: this thread's running max and sum of exp2 per row
    var l = vec4<f32>(0.0);
    let per_part = (heads * blocks + splits - 1u) / splits;
    let last = min(heads * blocks, (part + 1u) * per_part);
    for (var it = part * per_part; it < last; it = it + 1u) {
        let c0 = begin + (it % blocks) * C;
        let stream_head = select(head * group + it / blocks, head / group, ROWS_ARE_QUERIES);
        let col = c0 + 4u * tx;
        // dkdv: the L and Delta of this thread's 4 streamed queries, fetched now so that their
        // latency hides behind the staging (fetched after the scores, they cost 11% of the
        // cooperative kernel's time: run 32)
        var sts = array<vec2<f32>, 4>();
        if (!ROWS_ARE_QUERIES && MODE != MODE_LSE) {
            sts[0] = stats_of(b, col, stream_head);
            sts[1] = stats_of(b, col + 1u, stream_head);
            sts[2] = stats_of(b, col + 2u, stream_head);
            sts[3] = stats_of(b, col + 3u, stream_head);
        }
        // The block's X (dkdv: and Y), fetched into registers now so that X's latency hides
        // behind Y's staging and pass.
{{PREFETCH}}
        var dp = mat4x4<f32>();
        if (HAS_DP) {
            workgroupBarrier();     // the previous block's Ss, Ps are read
{{STAGE_Y}}
            workgroupBarrier();
{{DP}}
        }
        workgroupBarrier();
{{STAGE_X}}
        workgroupBarrier();
        var s = mat4x4<f32>();
{{SCORES}}
        let seen0 = visible(rows, col, causal);
        let seen1 = visible(rows, col + 1u, causal);
        let seen2 = visible(rows, col + 2u, causal);
        let seen3 = visible(rows, col + 3u, causal);
        if (MODE == MODE_LSE) {
            let top = max(mx, max(max(masked(s[0], seen0), masked(s[1], seen1)),
                                  max(masked(s[2], seen2), masked(s[3], seen3))));
            l = l * exp2(mx - top) + (weight(s[0], top, seen0) + weight(s[1], top, seen1))
                + (weight(s[2], top, seen2) + weight(s[3], top, seen3));
            mx = top;
        } else {
            // the statistics (L, Delta) belong to the fixed queries (dq) or to each streamed one (dkdv)
            var lse0 = row_lse; var lse1 = row_lse; var lse2 = row_lse; var lse3 = row_lse;
            var delta0 = row_delta; var delta1 = row_delta; var delta2 = row_delta; var delta3 = row_delta;
            if (!ROWS_ARE_QUERIES) {
                lse0 = vec4<f32>(sts[0].x); lse1 = vec4<f32>(sts[1].x); lse2 = vec4<f32>(sts[2].x);
                lse3 = vec4<f32>(sts[3].x);
                delta0 = vec4<f32>(sts[0].y); delta1 = vec4<f32>(sts[1].y); delta2 = vec4<f32>(sts[2].y);
                delta3 = vec4<f32>(sts[3].y);
            }
            let p0 = weight(s[0], lse0, seen0);
            let p1 = weight(s[1], lse1, seen1);
            let p2 = weight(s[2], lse2, seen2);
            let p3 = weight(s[3], lse3, seen3);
            Ps[tx * PR + ty] = p0 * (dp[0] - delta0);          // dS; streamed row 4tx + c at row 16c + tx:
            Ps[(16u + tx) * PR + ty] = p1 * (dp[1] - delta1);  // the 16 threads of a row store to 16
            Ps[(32u + tx) * PR + ty] = p2 * (dp[2] - delta2);  // different banks
            Ps[(48u + tx) * PR + ty] = p3 * (dp[3] - delta3);
            workgroupBarrier();
            let xc = tx * CV;
{{ACCUMULATE}}
            if (MODE == MODE_DKDV) {
                workgroupBarrier(); // dS X's reads of Ps and Ss are done
                Ps[tx * PR + ty] = p0;
                Ps[(16u + tx) * PR + ty] = p1;
                Ps[(32u + tx) * PR + ty] = p2;
                Ps[(48u + tx) * PR + ty] = p3;
{{RESTAGE_Y}}
                workgroupBarrier();
{{ACCUMULATE_V}}
            }
        }
    }
    if (MODE == MODE_LSE) {
        Ps[tx * PR + ty] = mx;      // Ps is not used by the blocks of this mode
        workgroupBarrier();
        let top = rows_max(ty);
        workgroupBarrier();
        Ps[tx * PR + ty] = l * exp2(mx - top);
        workgroupBarrier();
        let lse = (top + log2(rows_sum(ty))) * LN2;
        if (tx == 0u) {
            store_lse(part, b, head, rows.x, lse.x);
            store_lse(part, b, head, rows.y, lse.y);
            store_lse(part, b, head, rows.z, lse.z);
            store_lse(part, b, head, rows.w, lse.w);
        }
    } else {
        let base = part * m(8u);
        let by_row = transpose(o) * mf(6u);
        store_row(base, b, head, rows.x, tx, by_row[0]);
        store_row(base, b, head, rows.y, tx, by_row[1]);
        store_row(base, b, head, rows.z, tx, by_row[2]);
        store_row(base, b, head, rows.w, tx, by_row[3]);
        if (MODE == MODE_DKDV) {
            let dv_rows = transpose(ov);
            store_row(base + m(9u), b, head, rows.x, tx, dv_rows[0]);
            store_row(base + m(9u), b, head, rows.y, tx, dv_rows[1]);
            store_row(base + m(9u), b, head, rows.z, tx, dv_rows[2]);
            store_row(base + m(9u), b, head, rows.w, tx, dv_rows[3]);
        }
    }
}
