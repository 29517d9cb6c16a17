// Second stage of a split cached attention: out[(row, d)] = sum_p e^(m_p - M) acc_p[d] /
// sum_p e^(m_p - M) l_p over the SPLITS parts of each query-head row, M = max_p m_p; a part
// that saw no key holds m = lowest float, l = 0. One thread per output element.
// partials: per row and part [m, l, acc[D]]. meta: [N (outputs), SPLITS, D]

{{PRELUDE}}

{{BINDINGS}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wg, nwg, lid, 256u);
    if (i >= m(0u)) { return; }
    let splits = m(1u); let D = m(2u);
    let row = i / D;
    let d = i % D;
    let base = row * splits * (D + 2u);
    var top = partials[base];
    for (var p = 1u; p < splits; p = p + 1u) { top = max(top, partials[base + p * (D + 2u)]); }
    var num = 0.0;
    var den = 0.0;
    for (var p = 0u; p < splits; p = p + 1u) {
        let at = base + p * (D + 2u);
        let w = exp(partials[at] - top);
        den = den + w * partials[at + 1u];
        num = num + w * partials[at + 2u + d];
    }
    out[i] = num / den;
}
