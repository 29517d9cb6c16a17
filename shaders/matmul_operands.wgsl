// Operand addressing shared by the matmul kernels: per operand (A, B, then the
// epilogue's add and residual) meta holds batch strides (0 where it broadcasts) and
// the strides of its logical row and column, so transposed and broadcast operands
// need no copy. The epilogue activation is spliced in as act().

fn op_base(op: u32) -> u32 { return 5u + BR + op * (BR + 2u); }

fn boff(b: u32, op: u32) -> u32 {
    var rem = b;
    var off = 0u;
    let base = op_base(op);
    for (var d = i32(BR) - 1; d >= 0; d = d - 1) {
        let n = m(5u + u32(d));
        off = off + (rem % n) * m(base + u32(d));
        rem = rem / n;
    }
    return off;
}

fn srow(op: u32) -> u32 { return m(op_base(op) + BR); }
fn scol(op: u32) -> u32 { return m(op_base(op) + BR + 1u); }

fn act(x: f32) -> f32 { return {{ACTIVATION}}; }
