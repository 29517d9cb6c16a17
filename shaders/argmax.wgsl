// The index of each row's largest element (a decode step's greedy token): one workgroup of
// THREADS threads a row; each thread keeps the best (value, index) of its elements, loaded
// UNROLL at a time so that their loads overlap, then a tree in workgroup memory. A row is
// a few rounds of memory latency: with 256 threads 8 deep, Llama 3's 128,256 logits took
// 63 rounds, 71 us of a 2 ms decode step on the H100 (run 52). Ties go to the lower index
// and a NaN beats any number (argmax_order.wgsl); a row whose best is NaN or +inf (an
// overflow) gives -1, which the host refuses. out is i32. Element j of a row is VALUE
// at INDEX: the row's j-th value at j, or (a product's workgroups' best, VALUE and INDEX
// two words each) the j-th workgroup's best value at the column it found it.
// meta: [rows, N]

{{PRELUDE}}

{{BINDINGS}}

const THREADS: u32 = {{THREADS}}u;
const UNROLL: u32 = {{UNROLL}}u;

var<workgroup> best_v: array<f32, THREADS>;
var<workgroup> best_i: array<u32, THREADS>;

{{ORDER}}

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wg.y * nwg.x + wg.x;
    let N = m(1u);
    let t = lid.x;
    if (row >= m(0u)) { return; }
    let base = row * N;
    var bv = 0.0;
    var bi = 0xffffffffu;
    var i = t;
    for (; i + (UNROLL - 1u) * THREADS < N; i = i + UNROLL * THREADS) {
        var v: array<f32, UNROLL>;
        var at: array<u32, UNROLL>;
        for (var k = 0u; k < UNROLL; k = k + 1u) {
            let j = i + THREADS * k;
            v[k] = {{VALUE}};
            at[k] = {{INDEX}};
        }
        for (var k = 0u; k < UNROLL; k = k + 1u) {
            if (better(v[k], at[k], bv, bi)) { bv = v[k]; bi = at[k]; }
        }
    }
    for (; i < N; i = i + THREADS) {
        let j = i;
        let v = {{VALUE}};
        let at = {{INDEX}};
        if (better(v, at, bv, bi)) { bv = v; bi = at; }
    }
    best_v[t] = bv;
    best_i[t] = bi;
    workgroupBarrier();
    for (var s = THREADS / 2u; s > 0u; s = s >> 1u) {
        if (t < s && better(best_v[t + s], best_i[t + s], best_v[t], best_i[t])) {
            best_v[t] = best_v[t + s];
            best_i[t] = best_i[t + s];
        }
        workgroupBarrier();
    }
    if (t == 0u) {
        let top = best_v[0];
        out[row] = select(i32(best_i[0]), -1, is_nan(top) || bitcast<u32>(top) == 0x7f800000u);
    }
}
