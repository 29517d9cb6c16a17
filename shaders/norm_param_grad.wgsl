// Reduction archetype: a layer or RMS norm's parameter gradients, first stage. Each
// workgroup takes CHUNK consecutive rows of dout and x ([rows, N], read as VT: vec4s
// where N allows): first their statistics (mean, 0 for an RMS norm, and
// r = 1 / sqrt(variance + eps); GROUP threads a row), then for each column the sums over
// the chunk's rows of dout * (x - mean) * r (the weight's gradient) and, when K is 2, of
// dout (the bias's). A chunk writes K rows of NP (N padded) sums, zeros past N; with
// more than one chunk these are partials that a second dispatch (sum_to.wgsl) adds up.
// Reading the rows once for both sums replaces a pass writing dout * x_hat in full and
// two passes adding its rows and dout's.
// With INPUT_GRADIENT (codegen's norm_gradients: the norm's norm_grad on the same dout and
// x) the chunk's rows also get the norm's input gradient, from the same statistics:
// dx = r (g - mean(g) - x_hat mean(g x_hat)), g = dout w (no mean(g): RMS norm), plus a
// residual gradient where norm_residual gave one, written to dx_out; its own row kernel
// read dout and x again.
// meta: [rows, NV (N in VT), eps, N, NP (padded N in VT)]

{{PRELUDE}}

{{BINDINGS}}
{{DX_BINDING}}

alias VT = {{VT}};

const THREADS: u32 = {{THREADS}}u;
const CHUNK: u32 = {{CHUNK}}u;
const GROUP: u32 = THREADS / CHUNK;   // threads summing one row's statistics
const LANES: u32 = {{LANES}}u;        // threads summing one column, each a share of the rows
const K: u32 = {{K}}u;                // 2: weight and bias; 1: weight only (RMS norm)

var<workgroup> part: array<f32, THREADS>;
var<workgroup> stats: array<vec2<f32>, CHUNK>;
var<workgroup> lane_sums: array<array<VT, 2>, THREADS>;

fn hsum(v: VT) -> f32 { return {{HSUM}}; }

// The sum of v over the GROUP threads of t's row (every thread of the workgroup calls it).
fn group_sum(v: f32, t: u32) -> f32 {
    part[t] = v;
    workgroupBarrier();
    let first = t / GROUP * GROUP;
    var s = 0.0;
    for (var j = 0u; j < GROUP; j = j + 1u) { s = s + part[first + j]; }
    workgroupBarrier();
    return s;
}

// Column c's two sums over rows lane, lane + step, ... of the chunk's first `held`.
fn column_sums(c: u32, lane: u32, step: u32, held: u32, first: u32, NV: u32) -> array<VT, 2> {
    var w = VT(0.0);
    var b = VT(0.0);
    if (c < NV) {
        for (var k = lane; k < held; k = k + step) {
            let at = (first + k) * NV + c;
            let d = dout[at];
            let st = stats[k];
            w = w + d * (x[at] - VT(st.x)) * st.y;
            b = b + d;
        }
    }
    return array<VT, 2>(w, b);
}

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let rows = m(0u);
    let NV = m(1u);
    let eps = mf(2u);
    let n = f32(m(3u));
    let NP = m(4u);
    let chunk = wg.y * nwg.x + wg.x;
    let first = chunk * CHUNK;
    let t = lid.x;
    let row = first + t / GROUP;
    let g = t % GROUP;
    let live = row < rows;
    var s = 0.0;
    if ({{CENTER}} && live) {
        for (var i = g; i < NV; i = i + GROUP) { s = s + hsum(x[row * NV + i]); }
    }
    let mu = group_sum(s, t) / n;
    var q = 0.0;
    if (live) {
        for (var i = g; i < NV; i = i + GROUP) { let c = x[row * NV + i] - VT(mu); q = q + hsum(c * c); }
    }
    let r = inverseSqrt(group_sum(q, t) / n + eps);
{{INPUT_GRADIENT}}
    if (g == 0u) { stats[t / GROUP] = vec2<f32>(mu, r); }
    workgroupBarrier();
    let held = min(CHUNK, rows - first);
{{COLUMNS}}
}
