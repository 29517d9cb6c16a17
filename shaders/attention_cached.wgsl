// Attention over a KV cache (a generation step): SPLITS workgroups per (query, head, batch),
// each over its own range of the cache's rounds of 256 keys (with SPLITS > 1 they write
// parts that a second dispatch combines);
// 256 threads in GROUPS groups of 64. The visible keys 0..positions[b, t] go in blocks of
// 64, block r * GROUPS + g to group g in round r: a thread scores one key (its dot product
// with q, which waits in workgroup memory), the group takes the block's maximum and sum
// from workgroup memory, and each thread updates R of the D output dimensions (lanes
// along D: coalesced reads of v). Loops over a block are unrolled by codegen. The groups' running maxima, sums and accumulators
// combine at the end. Where D is a multiple of 4, keys are read as vec4s (a lane per key
// reads its own row: 16-byte loads waste less of each memory transaction than 4-byte ones).
// q, out: [B, T, H*D]; k, v (the caches): [B, S, HKV*D].
// q is rotated by RoPE at its position as it is loaded where codegen says so.
// Where codegen folds the step's cache_write in (WRITE_ROW), k and v are the cache's planes
// bound read-write, and a workgroup whose keys include the position first writes its kv
// head's rows there from k_new and v_new (the key rotated like cache_write.wgsl does) and
// waits on them (storageBarrier) before it reads any.
// meta: [T, S, H, HKV, scale, inv_freq[D/2] (with RoPE), the write's inv_freq[D/2] (where it rotates)]

{{PRELUDE}}

{{BINDINGS}}
{{WRITE_BINDINGS}}

{{ROPE_FN}}

const D: u32 = {{D}}u;
const R: u32 = {{R}}u;
const LANES: u32 = 64u;
const GROUPS: u32 = 4u;
const LOWEST: f32 = -3.4028234e38;
const SPLITS: u32 = {{SPLITS}}u;

var<workgroup> qs: array<{{KTYPE}}, {{QWORDS}}>;
var<workgroup> ps: array<array<f32, 64>, GROUPS>;
var<workgroup> group_max: array<f32, GROUPS>;
var<workgroup> group_sum: array<f32, GROUPS>;
var<workgroup> group_acc: array<array<f32, D>, GROUPS>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let T = m(0u); let S = m(1u); let H = m(2u); let HKV = m(3u);
    let scale = mf(4u);
    let t = wg.x / SPLITS; let h = wg.y; let b = wg.z;
    let split = wg.x % SPLITS;
    let tid = lid.x;
    let g = tid / LANES;
    let lane = tid % LANES;
    let hk = h / (H / HKV);
    let qb = (b * T + t) * H * D + h * D;
    let pos = u32(max(positions[b * T + t], 0));
    let end = min(S, pos + 1u);
    let per_split = (S + LANES * GROUPS * SPLITS - 1u) / (LANES * GROUPS * SPLITS);
    let keys_lo = split * per_split * LANES * GROUPS;   // the keys this workgroup's rounds cover
    let keys_hi = keys_lo + per_split * LANES * GROUPS;
{{LOAD_Q}}
{{WRITE_ROW}}
    workgroupBarrier();
    var mx = LOWEST;
    var l = 0.0;
    var acc: array<f32, R>;
    let rounds = (end + LANES * GROUPS - 1u) / (LANES * GROUPS);
    for (var r = split * per_split; r < min(rounds, (split + 1u) * per_split); r = r + 1u) {
        let first = (r * GROUPS + g) * LANES;
        let key = first + lane;
        var score = LOWEST;
        if (key < end) {
            let kb = ((b * S + key) * HKV * D + hk * D) / {{KWIDTH}}u;
            score = {{SCORE}};
        }
        ps[g][lane] = score;
        workgroupBarrier();
        var top = mx;
{{BLOCK_MAX}}
        let corr = exp(mx - top);
        workgroupBarrier();
        ps[g][lane] = select(0.0, exp(score - top), key < end);
        workgroupBarrier();
        var total = 0.0;
{{BLOCK_SUM}}
        l = l * corr + total;
        // Unrolled over the block's keys, past the last visible one re-reading it (with p = 0):
        // the loads are independent, so they are all in flight at once.
        let last = end - 1u;
        let stride = HKV * D;
        for (var i = 0u; i < R; i = i + 1u) {
            let d = lane + i * LANES;
            if (d < D) {
                let vb = b * S * stride + hk * D + min(d, D - 1u);
                var sum = 0.0;
{{V_SUM}}
                acc[i] = acc[i] * corr + sum;
            }
        }
        mx = top;
        workgroupBarrier();
    }
    if (lane == 0u) { group_max[g] = mx; group_sum[g] = l; }
    for (var i = 0u; i < R; i = i + 1u) {
        let d = lane + i * LANES;
        if (d < D) { group_acc[g][d] = acc[i]; }
    }
    workgroupBarrier();
    var top = LOWEST;
    for (var j = 0u; j < GROUPS; j = j + 1u) { top = max(top, group_max[j]); }
    var total = 0.0;
    for (var j = 0u; j < GROUPS; j = j + 1u) { total = total + group_sum[j] * exp(group_max[j] - top); }
    // One part (SPLITS > 1): its maximum, sum and unnormalised accumulator, for the
    // combining dispatch (attention_cached_combine.wgsl); else the output itself.
    let part = (((b * T + t) * H + h) * SPLITS + split) * (D + 2u);
    if (SPLITS > 1u && tid == 0u) { out[part] = top; out[part + 1u] = total; }
    for (var d = tid; d < D; d = d + 256u) {
        var sum = 0.0;
        for (var j = 0u; j < GROUPS; j = j + 1u) { sum = sum + group_acc[j][d] * exp(group_max[j] - top); }
        if (SPLITS > 1u) { out[part + 2u + d] = sum; } else { out[qb + d] = sum / total; }
    }
}
