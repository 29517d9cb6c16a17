// Shared prelude of every generated kernel: the per-dispatch parameter block
// ("meta", u32 words in a uniform buffer; floats stored as their bits) and the
// math helpers the pointwise expression table uses.

@group(0) @binding(0) var<uniform> params:  array<vec4<u32>, {{META_N}}>;

fn m(i: u32) -> u32 { return params[i >> 2u][i & 3u]; }
fn mf(i: u32) -> f32 { return bitcast<f32>(m(i)); }
fn mi(i: u32) -> i32 { return bitcast<i32>(m(i)); }

// Flat thread index of a 1-D grid folded into 2-D (at most 65535 workgroups per axis).
fn flat_index(wg: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>, size: u32) -> u32 {
    return (wg.y * nwg.x + wg.x) * size + lid.x;
}

// Element i of a tensor stored as bf16, two to a u32 word (element 2j in the lower half of
// word j): the word's half as the upper half of an f32, exact.
fn bf16_(word: u32, i: u32) -> f32 { return bitcast<f32>(select(word << 16u, word & 0xffff0000u, (i & 1u) == 1u)); }
// Four consecutive bf16 elements, the first at an index that is a multiple of 4: two words.
fn bf16x4_(w: vec2<u32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(vec4<u32>(w.x << 16u, w.x & 0xffff0000u, w.y << 16u, w.y & 0xffff0000u));
}

fn sigmoid_(x: f32) -> f32 { return 1.0 / (1.0 + exp(-x)); }

// tanh with full relative accuracy near 0 and no overflow for large |x|.
fn tanh_(x: f32) -> f32 {
    let a = abs(x);
    if (a < 0.5) {
        let x2 = x * x;
        return x * (1.0 + x2 * (-0.33333333333 + x2 * (0.13333333333 + x2 * (-0.053968253968
            + x2 * (0.021869488536 + x2 * -0.0088632355299)))));
    }
    let e = exp(-2.0 * min(a, 20.0));
    return sign(x) * (1.0 - e) / (1.0 + e);
}

// erfc with fractional error < 1.2e-7 everywhere (Numerical Recipes' erfcc, a
// Chebyshev fit); gelu uses it directly so its relative error stays small for x < 0.
fn erfc_(x: f32) -> f32 {
    let z = abs(x);
    let t = 1.0 / (1.0 + 0.5 * z);
    let p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806
        + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))));
    let r = t * exp(-z * z + p);
    return select(2.0 - r, r, x >= 0.0);
}

fn erf_(x: f32) -> f32 { return 1.0 - erfc_(x); }

fn gelu_(x: f32) -> f32 { return 0.5 * x * erfc_(-0.70710678118654752 * x); }

fn gelu_tanh_(x: f32) -> f32 {
    // 0.5 * (1 + tanh(u)) == sigmoid(2u): no cancellation for x << 0
    return x * sigmoid_(1.5957691216057308 * (x + 0.044715 * x * x * x));
}

fn pow_int_(x: f32, e: f32) -> f32 {
    // x ** e for an integral exponent, negative bases included (as numpy).
    let r = pow(abs(x), e);
    let odd = (i32(abs(e)) & 1) == 1;
    return select(r, -r, odd && x < 0.0);
}

// Derivatives of the two gelu forms, times the incoming gradient.
fn gelu_grad_(d: f32, x: f32) -> f32 {
    let pdf = 0.3989422804014327 * exp(-0.5 * x * x);
    return d * (0.5 * erfc_(-0.70710678118654752 * x) + x * pdf);
}

fn gelu_tanh_grad_(d: f32, x: f32) -> f32 {
    let u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
    let s = sigmoid_(2.0 * u);          // 0.5 * (1 + tanh(u))
    let t = 2.0 * s - 1.0;
    return d * (s + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x));
}

// By the bits: compilers may fold x != x away under fast-math assumptions.
fn is_finite_(x: f32) -> bool { return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u; }

// max(x, 0) that keeps NaN, as numpy and torch do, decided on the bits: NVIDIA's Vulkan
// driver turns select(x, 0.0, x < 0.0) into a max that drops NaN (seen through Dawn).
fn relu_(x: f32) -> f32 {
    let bits = bitcast<u32>(x);
    return select(x, 0.0, bits > 0x80000000u && bits <= 0xff800000u);
}

// +inf: Tint refuses a constant inf (bitcast<f32>(0x7f800000u) is folded and rejected).
var<private> inf_bits_: u32 = 0x7f800000u;
fn inf_() -> f32 { return bitcast<f32>(inf_bits_); }
