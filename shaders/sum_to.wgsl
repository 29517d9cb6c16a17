// sum_to (gradient of broadcasting): one thread per output element sums the input
// elements that broadcast onto it.
// meta: [total_out, count, out_shape[RANK], kept strides[RANK], reduced extents[RANK], input strides[RANK]]

{{PRELUDE}}

{{BINDINGS}}

const RANK: u32 = {{RANK}}u;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    let count = m(1u);
    var rem = idx;
    var base = 0u;
    for (var d = i32(RANK) - 1; d >= 0; d = d - 1) {
        let n = m(2u + u32(d));
        base = base + (rem % n) * m(2u + RANK + u32(d));
        rem = rem / n;
    }
    var acc = 0.0;
    for (var k = 0u; k < count; k = k + 1u) {
        var r = k;
        var off = base;
        for (var d = i32(RANK) - 1; d >= 0; d = d - 1) {
            let n = m(2u + 2u * RANK + u32(d));
            off = off + (r % n) * m(2u + 3u * RANK + u32(d));
            r = r / n;
        }
        acc = acc + x[off];
    }
    out[idx] = acc;
}
