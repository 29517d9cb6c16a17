// Copy archetype, a concat whose pieces' parts of an output row are all a multiple of 4
// wide (along axis a, a row is everything from axis a on): thread idx writes vec4 idx of
// the output (row idx / OUT4, vec4 column idx % OUT4, both divisions by constants) from
// the piece that holds that column. The general copy kernel
// (copy.wgsl) moves a float a thread through run-time divisions: 1.0 TB/s on the H100
// for the gradients [dq | dk | dv] of a training step.
// meta: [vec4s of the output]

{{PRELUDE}}

{{BINDINGS}}

const OUT4: u32 = {{OUT4}}u;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat_index(wg, nwg, lid, 256u);
    if (idx >= m(0u)) { return; }
    let row = idx / OUT4;
    let c = idx % OUT4;
{{PIECES}}
}
