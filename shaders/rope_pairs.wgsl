// Rotary position embedding (rotate-half form) on [batch, seq, heads*dim], a thread per
// four pairs: element j..j+3 of a head and its partners j+dim/2.., which rotate by the
// same angles, so each angle's cos and sin is computed once for both outputs and every
// load and store is a vec4 (dim a multiple of 8). Position offset + t, or (a generation
// step) positions[b, t]. The inverse frequencies come in meta (float64 on the host).
// meta: [total, seq, width, dim, offset, inverse, inv_freq[dim/2]]

{{PRELUDE}}

{{BINDINGS}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let unit = flat_index(wg, nwg, lid, 256u);
    if (unit >= m(0u) / 8u) { return; }
    let seq = m(1u);
    let width = m(2u);
    let half = m(3u) / 2u;
    let row = unit / (width / 8u);
    let c = unit % (width / 8u);
    let j = c % (half / 4u) * 4u;                       // the pair's first element in its head
    let at = row * width + c / (half / 4u) * 2u * half + j;
    let pos = f32({{POSITION}});
    let ang = pos * vec4<f32>(mf(6u + j), mf(7u + j), mf(8u + j), mf(9u + j));
    let cs = cos(ang);
    let sn = select(sin(ang), -sin(ang), m(5u) != 0u);
    let x1 = x[at / 4u];
    let x2 = x[(at + half) / 4u];
    out[at / 4u] = x1 * cs - x2 * sn;
    out[(at + half) / 4u] = x2 * cs + x1 * sn;
}
