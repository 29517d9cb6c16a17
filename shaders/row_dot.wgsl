// Reduction archetype: the dot products of a's and b's rows (over the last axis; attention's
// Delta = rowsum(dO * O)). GROUP consecutive threads take a row, each a VT (a vec4 where
// the rows allow) at a time, so a warp's loads cover whole rows; the group's sums are added
// in workgroup memory. THREADS / GROUP rows a workgroup.
// meta: [rows, NV (row length in VT)]

{{PRELUDE}}

{{BINDINGS}}

alias VT = {{VT}};

const THREADS: u32 = {{THREADS}}u;
const GROUP: u32 = {{GROUP}}u;

var<workgroup> part: array<f32, THREADS>;

fn hsum(v: VT) -> f32 { return {{HSUM}}; }

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let rows = m(0u);
    let NV = m(1u);
    let t = lid.x;
    let row = (wg.y * nwg.x + wg.x) * (THREADS / GROUP) + t / GROUP;
    let g = t % GROUP;
    var s = 0.0;
    if (row < rows) {
        for (var i = g; i < NV; i = i + GROUP) { s = s + hsum(a[row * NV + i] * b[row * NV + i]); }
    }
    part[t] = s;
    workgroupBarrier();
    if (g == 0u && row < rows) {
        var total = 0.0;
        for (var j = 0u; j < GROUP; j = j + 1u) { total = total + part[t + j]; }
        out[row] = total;
    }
}
