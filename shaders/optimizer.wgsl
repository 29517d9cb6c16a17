// Optimizer update of one parameter group, in place, with no host round trip: the
// global gradient norm is stats[1] (norm_total.wgsl; slot 0 holds the step's loss), the
// learning rate and bias corrections of this step come from `step`.
// A non-finite loss or norm leaves the parameter and its state untouched, so a NaN
// step loses nothing.
// meta:  [n, unused, kind (0 sgd, 1 adam, 2 adamw), lr_mult, wd, momentum, b1, b2, eps, clip (0 = off)]
// step:  [lr, 1 - b1^t, sqrt(1 - b2^t), first step (1.0 or 0.0)]

{{PRELUDE}}

@group(0) @binding(1) var<storage, read> grad: array<f32>;
@group(0) @binding(2) var<storage, read> stats: array<f32>;
@group(0) @binding(3) var<storage, read> step: array<f32>;
@group(0) @binding(4) var<storage, read_write> p: array<f32>;
@group(0) @binding(5) var<storage, read_write> s1: array<f32>;
@group(0) @binding(6) var<storage, read_write> s2: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_index(wg, nwg, lid, 256u);
    if (i >= m(0u)) { return; }
    let norm = stats[1];
    let loss = stats[0];
    if (!is_finite_(loss) || !is_finite_(norm)) { return; }
    let clip = mf(9u);
    var g = grad[i];
    if (clip > 0.0) { g = g * min(1.0, clip / (norm + 1e-6)); }
    let lr = step[0] * mf(3u);
    let wd = mf(4u);
    let kind = m(2u);
    var x = p[i];
    if (kind == 0u) {
        g = g + wd * x;
        let mom = mf(5u);
        if (mom != 0.0) {
            var buf = g;
            if (step[3] == 0.0) { buf = mom * s1[i] + g; }
            s1[i] = buf;
            g = buf;
        }
        p[i] = x - lr * g;
        return;
    }
    if (kind == 2u) { x = x * (1.0 - lr * wd); } else { g = g + wd * x; }
    let b1 = mf(6u);
    let b2 = mf(7u);
    let mv = b1 * s1[i] + (1.0 - b1) * g;
    let vv = b2 * s2[i] + (1.0 - b2) * (g * g);
    s1[i] = mv;
    s2[i] = vv;
    let denom = sqrt(vv) / step[2] + mf(8u);
    p[i] = x - (lr / step[1]) * (mv / denom);
}
