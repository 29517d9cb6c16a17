// Rotary position embedding (rotate-half form) on [batch, seq, heads*dim], a thread per
// PAIRS pairs: element j..j+PAIRS-1 of a head and its partners j+dim/2.., which rotate by
// the same angles, so each angle's cos and sin is computed once for both outputs. PAIRS
// is 4 (vec4 loads and stores) where dim is a multiple of 8, else 1. Position offset + t,
// or (a generation step) positions[b, t]. The inverse frequencies come in meta (float64
// on the host). One thread an element, each computing its own cos and sin, took 13 us a
// call for gpt-tiny's [8, 256, 384] on the H100 under timestamps; four pairs, 10 (run 39).
// meta: [total, seq, width, dim, offset, inverse, inv_freq[dim/2]]

{{PRELUDE}}

{{BINDINGS}}

const PAIRS: u32 = {{PAIRS}}u;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let unit = flat_index(wg, nwg, lid, 256u);
    if (unit >= m(0u) / (2u * PAIRS)) { return; }
    let seq = m(1u);
    let width = m(2u);
    let half = m(3u) / 2u;
    let row = unit / (width / (2u * PAIRS));
    let c = unit % (width / (2u * PAIRS));
    let j = c % (half / PAIRS) * PAIRS;               // the first pair's element in its head
    let at = row * width + c / (half / PAIRS) * 2u * half + j;
    let pos = f32({{POSITION}});
    let ang = pos * {{FREQUENCIES}};
    let cs = cos(ang);
    let sn = select(sin(ang), -sin(ang), m(5u) != 0u);
    let x1 = x[at / PAIRS];
    let x2 = x[(at + half) / PAIRS];
    out[at / PAIRS] = x1 * cs - x2 * sn;
    out[(at + half) / PAIRS] = x2 * cs + x1 * sn;
}
