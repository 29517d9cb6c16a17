// Attention archetype, cooperative-matrix path (flash attention forward, f16 operands on
// the tensor cores, f32 accumulation and softmax). One workgroup of 4 subgroups (128
// threads, subgroups of 32) per (block of BQ = 64 queries, head, batch); subgroup sg owns
// queries q0 + 16 sg .. + 15. Its Q rows (rounded to f16) are staged once through Kh and
// Vh (all 64 at once where they hold 32 rows each, else in rounds) and kept as D / 16
// left fragments. For each block of BKV = 16 keys (32 where D is 16 or 48), K and V are
// staged as f16 (key-major, rows padded by 8 halves): K's registers were fetched during the previous block's products, V's are fetched as the
// block starts and stored after its softmax, so that no load's latency stands between two
// barriers (staged as fetched, the forward ran 14% slower: run 32). Then each subgroup:
//   S [16 x BKV] = Q K^T in BKV / 16 result fragments, stored to its f32 scratch Sc;
//   its lanes run the online softmax on S * scale * log2(e) in f32 (the scores are f32
//   products of the f16-rounded q and k, rounded no further; a lane takes row lane % 16
//   and the keys of parity lane / 16, in an order (codegen's lane_column) so that the 32
//   lanes' scratch reads hit 32 banks; rows SS = BKV + BKV / 8 floats apart, for that and
//   for the stores):
//   P = exp2(S - m) rounded to f16 into its Ph and the row sum of the rounded P (what P V
//   multiplies), against a reference m per row that only moves when a block's max exceeds
//   it by more than LAZY (P <= 2^LAZY: f16 holds it, f32 sums it);
//   O += P V on D / 16 result fragments.
// Blocks of 16 keys keep the workgroup's memory at 12.3 KiB, so that three workgroups
// share an SM of the H100 (32 keys: 23 KiB, two; 28 KiB or more: one; runs 37, 40, 43).
// A result fragment cannot be scaled per row, so when a row's m moves while its O holds
// anything, every subgroup takes O through Sc (BKV / 16 fragments at a time) to multiply each
// row by its factor: a workgroup-uniform branch, rare after the first block (whose O is
// still 0). At the end O / l goes through Sc the same way, so that the lanes write whole
// rows of the output.
// q, k, v are activations: rounded to f16 without a range scan (like the matmul's forward
// operands).
// f32 on cooperative matrices (codegen's split_products): Q, K, V and P are each staged as
// two f16 parts, hi and lo (Kl, Vl, Pl), and each product is three (hi lo + lo hi + hi hi,
// as the split matmul's); Q is scaled once, and each block's K and V, by the power of two
// that puts its largest |value| in [2^14, 2^15), so that hi stays in f16's range and lo
// above its subnormals. The scores are multiplied back in f32; O's fragments hold O times
// V's scale, which a block only ever lowers (they are multiplied by the ratio, exact), and
// are divided by it at the end. The workgroup meets the blocks' largest values in `red`
// at barriers it already has: K's at the end of the block before, V's before the scores
// are read.
// Causal: key blocks above the workgroup's last query are skipped; keys past a query (or
// past S) are masked, and a row with no visible key comes out 0, not NaN.
// Split (SPLIT): the workgroup's key blocks are shared among `splits` workgroups, each
// writing its unnormalised O rows and its rows' maxima and sums in attention_tiled.wgsl's
// layout, which attention_splits.wgsl combines.
// LSE_AT > 0 (attention_stats): out also holds each row's log-sum-exp (natural log, of
// the scores of the f16-rounded q and k), [B, T, H] from element LSE_AT on; with SPLIT
// attention_splits.wgsl writes it.
// q, out: [B, T, H*D]; k, v: [B, S, HKV*D] (D % 16 == 0, D <= 128).
// meta: [T, S, H, HKV, causal, scale * log2(e), splits, B]; grid: (ceil(T / BQ), H, B * splits)

{{PRELUDE}}

{{BINDINGS}}

const D: u32 = {{D}}u;
const D4: u32 = D / 4u;
const BQ: u32 = 64u;
const BKV: u32 = {{BKV}}u;
const THREADS: u32 = 128u;
const KS: u32 = D + {{PAD}}u;       // halves a row of Kh and Vh (and of Q, staged in both)
const PS: u32 = BKV + {{PAD}}u;     // halves a row of a subgroup's Ph
const SS: u32 = {{SS}}u;          // floats a row of a subgroup's Sc (S: BKV keys; O: 2 fragments at a time)
const NEG: f32 = -1.0e30;     // finite "no score yet"
const LAZY: f32 = 8.0;        // how far (log2 units) a row's max may pass its reference m
const SPLIT: bool = {{SPLIT}};
const LSE_AT: u32 = {{LSE_AT}}u;   // attention_stats: where the rows' log-sum-exp go in out (0: none)

var<workgroup> Kh: array<f16, BKV * KS>;
var<workgroup> Vh: array<f16, BKV * KS>;
var<workgroup> Ph: array<f16, 4u * 16u * PS>;
var<workgroup> Sc: array<f32, 4u * 16u * SS>;
var<workgroup> moved: array<u32, 4>;    // whether a subgroup's O needs rescaling this block
var<workgroup> Inv: array<f32, 64>;     // 1 / l of each row, for the output
{{SPLIT_DECLS}}

// Element e of rows r0.. of q, k or v (`which`; [B, n, heads * D], head hx), row-major;
// rows past `n` are zero. Neighbouring threads read a row's neighbouring vec4s.
fn fetch_rows(e: u32, b: u32, hx: u32, r0: u32, n: u32, heads: u32, which: u32) -> vec4<f32> {
    let j = e / D4;
    if (r0 + j >= n) { return vec4<f32>(0.0); }
    let at = ((b * n + r0 + j) * heads + hx) * D4 + e % D4;
    if (which == 0u) { return q[at]; }
    if (which == 1u) { return k[at]; }
    return v[at];
}

{{PUT_TILES}}

{{ENTRY}}
    let scale = mf(5u);
    let splits = m(6u);
    let B = m(7u);
    let h = wg.y;
    let b = wg.z / splits;
    let part = wg.z % splits;
    let hk = h / (H / HKV);
    let q0 = wg.x * BQ;
    let r = lane % 16u;             // this lane's row of the subgroup's 16
    let half = lane / 16u;          // and the parity of its keys and columns
    let t = q0 + 16u * sg + r;
    let sb = sg * 16u * SS;         // the subgroup's scratch
    let pb = sg * 16u * PS;
    var key_end = S;                // row t sees keys < key_end
    var kv_end = S;                 // the workgroup's rows see keys < kv_end
    if (causal) {
        key_end = min(S, t + 1u);
        kv_end = min(S, q0 + BQ);
    }
{{STAGE_Q}}
    workgroupBarrier();
{{LOAD_Q}}
    workgroupBarrier();             // Q's fragments are read before the first K block takes Kh
    var mx = NEG;                   // the row's reference m (log2 units)
    var l = 0.0;                    // this lane's keys' share of its row's sum
{{RESULTS}}
    let blocks = (kv_end + BKV - 1u) / BKV;
    let per_part = (blocks + splits - 1u) / splits;
    let last = min(blocks, (part + 1u) * per_part);
{{FETCH_FIRST}}
{{FIRST_K_SCALE}}
    for (var kb = part * per_part; kb < last; kb = kb + 1u) {
        let k0 = kb * BKV;
{{STAGE}}
        workgroupBarrier();         // K staged (the last block read Kh, Vh and Ph before this)
{{SCORES}}
{{FETCH_NEXT}}
        workgroupBarrier();
        var sv: array<f32, {{LANE_KEYS}}>;     // scores of keys k0 + 2 ((c + r) % {{LANE_KEYS}}) + half
{{READ_SCORES}}
        var top = NEG;
{{ROW_MAX}}
        top = max(top, subgroupShuffleXor(top, 16u));
        let moves = top > mx + LAZY;
        let mx_new = select(mx, top, moves);
        let corr = exp2(mx - mx_new);
        let any_moved = subgroupMax(select(0u, 1u, moves && mx > NEG));
        if (lane == 0u) { moved[sg] = any_moved; }
        var sum = 0.0;
{{PROBABILITIES}}
        l = l * corr + sum;
        mx = mx_new;
{{PUT_V}}
{{NEXT_K_TOP}}
        let flags = workgroupUniformLoad(&moved);    // also: Ph is written and Sc's scores are read
{{NEXT_K_SCALE}}
        if (flags[0] + flags[1] + flags[2] + flags[3] > 0u) {
{{RESCALE}}
        }
{{PV}}
    }
    let total = l + subgroupShuffleXor(l, 16u);
    var inv = select(0.0, 1.0 / total, total > 0.0);
    if (SPLIT) { inv = 1.0; }
{{UNSCALE_O}}
    workgroupBarrier();             // the last block's Ph is read
    if (half == 0u) { Inv[16u * sg + r] = inv; }
    let base = part * B * T * H * D;
{{WRITE_O}}
    if (!SPLIT && LSE_AT > 0u && half == 0u && t < T) {
        out[LSE_AT + (b * T + t) * H + h] = (mx + log2(total)) * 0.6931471805599453;
    }
    if (SPLIT && half == 0u && t < T) {
        // a part's row maximum and sum, as attention_tiled.wgsl's vec4s of 4 queries' stats
        let at = splits * B * T * H * D + ((((part * B + b) * H + h) * ((T + 3u) / 4u) + t / 4u) * 2u) * 4u + t % 4u;
        out[at] = mx;
        out[at + 4u] = total;
    }
}
