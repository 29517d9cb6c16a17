// Copy archetype (transpose, slice, pad, concat, broadcast_to): one thread per output
// element reads from the piece that covers its coordinate along AXIS (zero where no
// piece does: padding). Each piece k is [start, start + len) along AXIS of the output
// and reads its operand at base + sum(coord * stride), coordinates relative to start.
// meta: [total, out_shape[RANK], per piece: start, len, base, strides[RANK]]

{{PRELUDE}}

{{BINDINGS}}

const RANK: u32 = {{RANK}}u;
const AXIS: u32 = {{AXIS}}u;

fn piece_offset(p: u32, idx: u32) -> u32 {
    let pb = 1u + RANK + p * (3u + RANK);
    var rem = idx;
    var off = m(pb + 2u);
    for (var d = i32(RANK) - 1; d >= 0; d = d - 1) {
        let n = m(1u + u32(d));
        var c = rem % n;
        rem = rem / n;
        if (u32(d) == AXIS) { c = c - m(pb); }
        off = off + c * m(pb + 3u + u32(d));
    }
    return off;
}

fn axis_coord(idx: u32) -> u32 {
    var rem = idx;
    for (var d = i32(RANK) - 1; d > i32(AXIS); d = d - 1) { rem = rem / m(1u + u32(d)); }
    return rem % m(1u + AXIS);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    let c = axis_coord(idx);
{{PIECES}}
    out[idx] = {{ZERO}};
}
