// sum_to (gradient of broadcasting): each output element's sum is split over LANES
// threads of one workgroup (OUTS outputs x LANES lanes = 256 threads), then the lanes
// are added in workgroup memory. Consecutive threads take consecutive outputs, so the
// usual case (a bias gradient: summing [rows, n] down to [n]) reads rows coalesced,
// and a long reduction keeps many workgroups busy instead of one thread per output.
// meta: [total_out, count, out_shape[RANK], kept strides[RANK], reduced extents[RANK], input strides[RANK]]

{{PRELUDE}}

{{BINDINGS}}

const RANK: u32 = {{RANK}}u;
const OUTS: u32 = {{OUTS}}u;
const LANES: u32 = 256u / OUTS;

var<workgroup> part: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = lid.x;
    let col = t % OUTS;
    let lane = t / OUTS;
    let idx = (wg.y * nwg.x + wg.x) * OUTS + col;
    let count = m(1u);
    var acc = 0.0;
    if (idx < m(0u)) {
        var rem = idx;
        var base = 0u;
        for (var d = i32(RANK) - 1; d >= 0; d = d - 1) {
            let n = m(2u + u32(d));
            base = base + (rem % n) * m(2u + RANK + u32(d));
            rem = rem / n;
        }
        for (var k = lane; k < count; k = k + LANES) {
            var r = k;
            var off = base;
            for (var d = i32(RANK) - 1; d >= 0; d = d - 1) {
                let n = m(2u + 2u * RANK + u32(d));
                off = off + (r % n) * m(2u + 3u * RANK + u32(d));
                r = r / n;
            }
            acc = acc + x[off];
        }
    }
    part[t] = acc;
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s = s >> 1u) {
        if (lane < s) { part[t] = part[t] + part[t + s * OUTS]; }
        workgroupBarrier();
    }
    if (lane == 0u && idx < m(0u)) { out[idx] = part[t]; }
}
