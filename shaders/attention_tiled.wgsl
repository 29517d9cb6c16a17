// Attention archetype, tiled path (flash attention forward, f32). One workgroup of
// 4 * BQ threads per (block of BQ queries, head, batch) loops over blocks of BKV = 64 keys:
// it stages its Q block once, then for each key block K (d-major) into workgroup memory,
// each thread scores 4 queries x 4 keys, the rows' maxima meet in workgroup memory (16
// threads share a row), P = exp(S - max) goes to workgroup memory while V replaces K in the
// same buffer, and each thread accumulates O for its 4 queries x 4 columns in registers,
// rescaled when a row's max grows (online softmax).
// Why 4 x 4 scores: the kernel is bound by workgroup-memory reads, not by FMAs; a 4 x 4
// tile reads 0.5 floats a multiply-add (4 x 2: 0.75) and halves the reads of Q per key.
// Why K and V share a buffer: it keeps BQ = 32 at D = 64 inside 37 KiB (NVIDIA offers 48).
// BQ is 32 where the device's workgroup memory holds it, else 16 (lavapipe's 32 KiB at D
// above 52): workgroup_bytes() in codegen says how much each takes.
// Layouts: Qs d-major (a vec4 = a thread's 4 queries), scaled by scale * log2(e) so the
// softmax runs on exp2; K d-major in KVs (a vec4 = a thread's 4 keys); V key-major in KVs
// (a vec4 = a thread's 4 columns); Ps key-major (a vec4 = 4 queries; key 4i + c at row 16c + i). Rows of Ps and red
// are padded by one vec4 so the 16 threads of a row write to different banks.
// Causal: key blocks above the diagonal are skipped; keys past a query (or past S) are
// masked, and a row with no visible key comes out 0, not NaN.
// Prefetch: V is fetched into registers before the scores and stored after them, and
// the next block's K before P . V, stored at the next block's start, so that each load's
// latency hides behind a phase of arithmetic (codegen's _forward_staging).
// The loops over d, over a block's keys and the staging are unrolled by codegen: llvmpipe
// (lavapipe) ends an invocation after ~65535 loop iterations in total and leaves the rest
// undone; a few are left a key block.
// Split (SPLIT): when (T / BQ) x H x B workgroups cannot fill the GPU, the key blocks of a
// workgroup's rows are shared among `splits` workgroups, and each writes its unnormalised
// O rows and its rows' maxima and sums for attention_splits.wgsl to combine.
// q, out: [B, T, H*D]; k, v: [B, S, HKV*D], all read as vec4 (D % 4 == 0, D <= 64).
// With SPLIT, out holds [splits, B, T, H*D] partial O, then per (part, b, h, 4 queries) a
// vec4 of row maxima and one of row sums.
// Thread (tx < 16, ty), a warp 8 x 4 of them (THREAD_XY: codegen's thread layouts): ty owns
// queries 4ty..4ty+3, tx keys 4tx..4tx+3 of each block and output columns 4tx..4tx+3
// (threads with tx >= D / 4 own no column).
// LSE_AT > 0 (attention_stats, a training graph's forward): out also holds each row's
// log-sum-exp of its scaled scores (natural log), [B, T, H] from element LSE_AT on, for the
// backward; with SPLIT attention_splits.wgsl writes it.
// meta: [T, S, H, HKV, causal, scale * log2(e), splits, B]; grid: (ceil(T / BQ), H, B * splits)

{{PRELUDE}}

{{BINDINGS}}

const D: u32 = {{D}}u;
const D4: u32 = D / 4u;
const BQ: u32 = {{BQ}}u;
const BKV: u32 = 64u;
const THREADS: u32 = 4u * BQ;
const QV: u32 = BQ / 4u;      // vec4s in a d-row of Qs
const KV4: u32 = BKV / 4u;    // vec4s in a d-row of K
const KR: u32 = KV4 + 1u;     // a d-row of K padded by a vec4 (staging stores hit 32 banks)
const PS: u32 = QV + 1u;      // padded row of Ps and red
const NEG: f32 = -1.0e30;     // finite "no score yet": exp2(NEG - NEG) stays a number
const SPLIT: bool = {{SPLIT}};
const LSE_AT: u32 = {{LSE_AT}}u;

var<workgroup> Qs: array<vec4<f32>, D * QV>;
var<workgroup> KVs: array<vec4<f32>, D * KR>;    // K, then V, of the current key block
var<workgroup> Ps: array<vec4<f32>, BKV * PS>;
var<workgroup> red: array<vec4<f32>, 16u * PS>;   // one partial per (thread column tx, query vec4)

// Scores as 4 columns (one per key) of 4 queries; O as 4 columns (one per query) of 4 outputs.
fn outer_step(acc: mat4x4<f32>, a: vec4<f32>, b: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(fma(a, vec4<f32>(b.x), acc[0]), fma(a, vec4<f32>(b.y), acc[1]),
                       fma(a, vec4<f32>(b.z), acc[2]), fma(a, vec4<f32>(b.w), acc[3]));
}

fn scale_columns(o: mat4x4<f32>, c: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(o[0] * c.x, o[1] * c.y, o[2] * c.z, o[3] * c.w);
}

// x = dims 4 * d4 .. 4 * d4 + 3 of query i (key j) into the d-major Qs (K in KVs).
fn put_q(d4: u32, i: u32, x: vec4<f32>) {
    let at = d4 * 4u * QV + i / 4u;
    let c = i % 4u;
    Qs[at][c] = x.x; Qs[at + QV][c] = x.y; Qs[at + 2u * QV][c] = x.z; Qs[at + 3u * QV][c] = x.w;
}

fn put_k(d4: u32, j: u32, x: vec4<f32>) {
    let at = d4 * 4u * KR + j / 4u;
    let c = j % 4u;
    KVs[at][c] = x.x; KVs[at + KR][c] = x.y; KVs[at + 2u * KR][c] = x.z; KVs[at + 3u * KR][c] = x.w;
}

// Queries q0.. of head h, times scale * log2(e); rows past T are zero.
fn stage_q(tid: u32, b: u32, h: u32, q0: u32) {
    let T = m(0u);
    let H = m(2u);
    let scale = mf(5u);
    for (var e = tid; e < BQ * D4; e = e + THREADS) {
        let i = e % BQ;   // neighbouring threads: neighbouring queries, neighbouring banks
        let d4 = e / BQ;
        var x = vec4<f32>(0.0);
        if (q0 + i < T) { x = q[((b * T + q0 + i) * H + h) * D4 + d4] * scale; }
        put_q(d4, i, x);
    }
}

// Element e of the key block k0.. of kv head hk: K (d-major; 16 neighbouring threads take 16
// keys, the next 16 the next vec4 of those keys: 32 contiguous bytes of each of 16 rows a
// warp, and with K's d-rows padded by a vec4 the transposing stores of a warp hit 32
// distinct banks; 8 keys x 4 vec4s hit 8 banks 4 times) or V (key-major, row by row);
// rows past S are zero (P is 0 there, 0 * garbage is not). fetch_* reads it into a
// register, put_* stores it: codegen issues the fetches a phase before the stores (see
// the header) so that their latency hides behind arithmetic.
fn key_of(e: u32) -> u32 { return e / (16u * D4) * 16u + e % 16u; }
fn dim4_of(e: u32) -> u32 { return e / 16u % D4; }

fn fetch_k(e: u32, b: u32, hk: u32, k0: u32) -> vec4<f32> {
    let j = key_of(e);
    if (e >= BKV * D4 || k0 + j >= m(1u)) { return vec4<f32>(0.0); }
    return k[((b * m(1u) + k0 + j) * m(3u) + hk) * D4 + dim4_of(e)];
}

fn put_k_element(e: u32, x: vec4<f32>) {
    if (e < BKV * D4) { put_k(dim4_of(e), key_of(e), x); }
}

fn fetch_v(e: u32, b: u32, hk: u32, k0: u32) -> vec4<f32> {
    let j = e / D4;
    if (e >= BKV * D4 || k0 + j >= m(1u)) { return vec4<f32>(0.0); }
    return v[((b * m(1u) + k0 + j) * m(3u) + hk) * D4 + e % D4];
}

fn put_v_element(e: u32, x: vec4<f32>) {
    if (e < BKV * D4) { KVs[e] = x; }
}

{{ROWS}}

// Row t's columns 4 c4.. of part `part` (0 without SPLIT).
fn store_row(part: u32, b: u32, h: u32, t: u32, c4: u32, x: vec4<f32>) {
    let T = m(0u);
    if (t < T) { out[(((part * m(7u) + b) * T + t) * m(2u) + h) * D4 + c4] = x; }
}

// A part's row maxima and sums of queries t.. t + 3 (t % 4 == 0), after all parts' O rows.
fn store_stats(part: u32, b: u32, h: u32, t: u32, mx: vec4<f32>, l: vec4<f32>) {
    let T = m(0u);
    let H = m(2u);
    let splits = m(6u);
    let base = splits * m(7u) * T * H * D4;
    let at = base + (((part * m(7u) + b) * H + h) * ((T + 3u) / 4u) + t / 4u) * 2u;
    if (t < T) { out[at] = mx; out[at + 1u] = l; }
}

// Row t's log-sum-exp into element LSE_AT + (b T + t) H + h of out.
fn store_lse(b: u32, h: u32, t: u32, x: f32) {
    let T = m(0u);
    let e = LSE_AT + (b * T + t) * m(2u) + h;
    if (t < T) { out[e / 4u][e % 4u] = x; }
}

fn masked(s: vec4<f32>, seen: vec4<bool>) -> vec4<f32> { return select(vec4<f32>(NEG), s, seen); }

fn probabilities(s: vec4<f32>, mx: vec4<f32>, seen: vec4<bool>) -> vec4<f32> {
    return select(vec4<f32>(0.0), exp2(s - mx), seen);
}

@compute @workgroup_size({{THREADS}})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let S = m(1u);
    let H = m(2u);
    let causal = m(4u) != 0u;
    let splits = m(6u);
    let h = wg.y;
    let b = wg.z / splits;
    let part = wg.z % splits;
    let hk = h / (H / m(3u));
    let q0 = wg.x * BQ;
{{THREAD_XY}}
    let rows = vec4<u32>(q0 + 4u * ty) + vec4<u32>(0u, 1u, 2u, 3u);
    var key_end = vec4<u32>(S);     // row i sees keys < key_end[i]
    var kv_end = S;                 // the workgroup's rows see keys < kv_end
    if (causal) {
        key_end = min(key_end, rows + 1u);
        kv_end = min(S, q0 + BQ);
    }
    stage_q(tid, b, h, q0);
    var mx = vec4<f32>(NEG);
    var l = vec4<f32>(0.0);         // this thread's keys' share of each row's sum
    var o = mat4x4<f32>();
    let blocks = (kv_end + BKV - 1u) / BKV;
    let per_part = (blocks + splits - 1u) / splits;
    let last = min(blocks, (part + 1u) * per_part);
{{FIRST_K}}
    for (var kb = part * per_part; kb < last; kb = kb + 1u) {
        let k0 = kb * BKV;
        workgroupBarrier();         // the previous block's Ps and V are read
{{STAGE_K}}
        workgroupBarrier();
{{FETCH_V}}
        var s = mat4x4<f32>();
{{SCORES}}
        let key = k0 + 4u * tx;
        let seen0 = vec4<u32>(key) < key_end;
        let seen1 = vec4<u32>(key + 1u) < key_end;
        let seen2 = vec4<u32>(key + 2u) < key_end;
        let seen3 = vec4<u32>(key + 3u) < key_end;
        red[tx * PS + ty] = max(max(masked(s[0], seen0), masked(s[1], seen1)),
                                max(masked(s[2], seen2), masked(s[3], seen3)));
        workgroupBarrier();         // red is written and K is read: V may replace it
{{STAGE_V}}
        let mx_new = max(mx, rows_max(ty));
        let corr = exp2(mx - mx_new);
        let p0 = probabilities(s[0], mx_new, seen0);
        let p1 = probabilities(s[1], mx_new, seen1);
        let p2 = probabilities(s[2], mx_new, seen2);
        let p3 = probabilities(s[3], mx_new, seen3);
        Ps[tx * PS + ty] = p0;      // key 4tx + c at row 16c + tx: the 16 threads of a row
        Ps[(16u + tx) * PS + ty] = p1;  // store to 16 different banks
        Ps[(32u + tx) * PS + ty] = p2;
        Ps[(48u + tx) * PS + ty] = p3;
        l = l * corr + (p0 + p1) + (p2 + p3);
        o = scale_columns(o, corr);
        mx = mx_new;
        workgroupBarrier();
{{FETCH_K}}
        if (tx < D4) {
{{ACCUMULATE}}
        }
    }
    red[tx * PS + ty] = l;          // red's last readers passed the barrier before P . V
    workgroupBarrier();
    let total = rows_sum(ty);
    var inv = select(vec4<f32>(0.0), 1.0 / total, total > vec4<f32>(0.0));
    if (SPLIT) {
        inv = vec4<f32>(1.0);
        if (tx == 0u) { store_stats(part, b, h, rows.x, mx, total); }
    } else if (LSE_AT > 0u && tx == 0u) {
        let lse = (mx + log2(total)) * 0.6931471805599453;
        store_lse(b, h, rows.x, lse.x);
        store_lse(b, h, rows.y, lse.y);
        store_lse(b, h, rows.z, lse.z);
        store_lse(b, h, rows.w, lse.w);
    }
    if (tx < D4) {
        store_row(part, b, h, rows.x, tx, o[0] * inv.x);
        store_row(part, b, h, rows.y, tx, o[1] * inv.y);
        store_row(part, b, h, rows.z, tx, o[2] * inv.z);
        store_row(part, b, h, rows.w, tx, o[3] * inv.w);
    }
}
