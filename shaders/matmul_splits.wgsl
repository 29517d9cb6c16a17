// Matmul archetype, second stage of a split-K kernel. When a matmul's output has too few
// tiles to fill the GPU, codegen cuts K into slices, each a workgroup of its own
// (matmul_tiled.wgsl writes each slice's raw sums into `partials`, slice after slice);
// this kernel adds the slices and applies the node's epilogue (bias, activation,
// residual), one thread per output element. The few-row vector kernel's slices
// (matmul_vector.wgsl) come here too: SPLIT_SUMS adds their second product and the
// norm's sums of squares, where they have them. A product that also adds up an operand
// (product_sums.py) left each slice's sums after all the slices' results: threads past
// the results add those into `sums_out` (SUMS_FINISH).
// meta: the first stage's (matmul_tiled.wgsl), then the slice count (a word, not a
// constant, so that nodes cut into different counts share a pipeline); grid:
// ceil((nbatch * M * N + sums) / 256), folded.

{{PRELUDE}}

{{BINDINGS}}
{{SUMS_BINDING}}

const BR: u32 = {{BR}}u;
const SPLITS_WORD: u32 = {{SPLITS_WORD}}u;   // the meta word after the first stage's: the slice count

{{OPERANDS}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let M = m(0u);
    let N = m(1u);
    let total = M * N * m(3u);
    let i = flat_index(wg, nwg, lid, 256u);
    let splits = m(SPLITS_WORD);
{{SUMS_FINISH}}
    if (i >= total) { return; }
    var v = partials[i];
    for (var p = 1u; p < splits; p = p + 1u) { v = v + partials[p * total + i]; }
    let col = i % N;
    let row = (i / N) % M;
    let b = i / (M * N);
{{SPLIT_SUMS}}
{{EPILOGUE}}
    out[i] = v;
}
