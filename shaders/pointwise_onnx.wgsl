// Helpers of the pointwise ops the ONNX importer added (appended to a pointwise kernel
// after its entry point, only when its program uses one of them). NaN is decided on the
// bits: compilers may fold x != x away, and drivers turn selects into max/min that drop it.

fn is_nan_(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }

// A quiet NaN; Tint refuses a NaN constant, as it does inf (common.wgsl's inf_).
var<private> nan_bits_: u32 = 0x7fc00000u;
fn nan_() -> f32 { return bitcast<f32>(nan_bits_); }

// erf with relative error < 2e-7 (float32 evaluation, measured against scipy): Cephes'
// erff polynomial for |x| < 1, 1 - erfc (common.wgsl's erfc_, fractional error < 1.2e-7,
// where erf >= 0.84) beyond; no cancellation near 0, as 1 - erfc_(x) would have.
fn erf_accurate_(x: f32) -> f32 {
    if (abs(x) < 1.0) {
        let z = x * x;
        return x * (1.128379165726710 + z * (-0.3761262582423300 + z * (0.1128358514861418
            + z * (-0.02685381193529856 + z * (0.005188327685732524 + z * (-0.0008010193625184903
            + z * 0.00007853861353153693))))));
    }
    return 1.0 - erfc_(x);
}

// log(1 + u) for 0 <= u <= 1 as 2 atanh(s), s = u / (2 + u) <= 1/3, by its odd series:
// relative error of a few ulp, where log(1 + u) would lose all of u's digits below
// log's absolute error (2^-21 allowed by Vulkan, seen on lavapipe).
fn log1p_(u: f32) -> f32 {
    let s = u / (2.0 + u);
    let z = s * s;
    return 2.0 * s * (1.0 + z * (0.33333333333 + z * (0.2 + z * (0.14285714286 + z * (0.11111111111
        + z * (0.09090909091 + z * (0.07692307692 + z * (0.06666666667 + z * 0.05882352941))))))));
}

// log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)): no overflow, keeps NaN, exact for x << 0.
fn softplus_(x: f32) -> f32 { return relu_(x) + log1p_(exp(-abs(x))); }

fn sign_(x: f32) -> f32 { return select(sign(x), x, is_nan_(x)); }

// x if x >= 0 else alpha * x; negativity by the bits (NaN and -0.0 pass through).
fn leaky_relu_(x: f32, alpha: f32) -> f32 {
    let bits = bitcast<u32>(x);
    return select(x, alpha * x, bits > 0x80000000u && bits <= 0xff800000u);
}

// numpy's maximum / minimum: NaN in either operand gives NaN.
fn maximum_(a: f32, b: f32) -> f32 { return select(select(max(a, b), b, is_nan_(b)), a, is_nan_(a)); }
fn minimum_(a: f32, b: f32) -> f32 { return select(select(min(a, b), b, is_nan_(b)), a, is_nan_(a)); }

// A mask value is true when it is not +-0 (NaN counts as true, as numpy's c != 0).
fn truthy_(c: f32) -> bool { return (bitcast<u32>(c) & 0x7fffffffu) != 0u; }

// numpy's x ** y for a tensor exponent: negative bases with integral exponents take the
// parity's sign, with other exponents NaN; x ** 0 == 1 ** y == 1; (-1) ** +-inf == 1.
fn power_(x: f32, y: f32) -> f32 {
    let ax = abs(x);
    let ay = abs(y);
    if (y == 0.0 || x == 1.0 || (ax == 1.0 && ay > 3.4028234e38)) { return 1.0; }
    if (is_nan_(x) || is_nan_(y)) { return nan_(); }
    // 0 ** y and inf ** y spelled out: WGSL leaves pow undefined at 0
    let edge = select(0.0, inf_(), (ax == 0.0) == (y < 0.0));
    let r = select(pow(ax, y), edge, ax == 0.0 || ax > 3.4028234e38);
    if (bitcast<u32>(x) < 0x80000000u) { return r; }
    if (floor(y) != y) {
        return select(nan_(), r, x == 0.0);   // (-0) ** 0.5 == 0, like C's pow
    }
    let odd = ay < 16777216.0 && (i32(y) & 1) != 0;
    return select(r, -r, odd);
}
