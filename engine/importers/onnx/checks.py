"""Element types, what the importer refuses before translating (attribute checks per op type), and the
``Refused`` signal a translation raises for what it cannot express exactly.
"""

from __future__ import annotations

from typing import Any, Callable


MIN_OPSET = 13

# ONNX TensorProto element types
FLOAT, UINT8, INT8, UINT16, INT16, INT32, INT64, STRING, BOOL, FLOAT16, DOUBLE = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11
BFLOAT16 = 16
INT_TYPES = (UINT8, INT8, UINT16, INT16, INT32, INT64)
GRAPH_TYPES = {FLOAT: "f32", INT32: "i32", INT64: "i32"}  # what graph inputs/outputs may be


class Refused(Exception):
    """One node cannot be translated (the message says why)."""


def _attrs(node) -> dict[str, Any]:
    from onnx import helper
    out = {}
    for a in node.attribute:
        if a.ref_attr_name:
            raise Refused(f"attribute {a.name} refers to a function attribute")
        out[a.name] = helper.get_attribute_value(a)
    return out


# ---------------------------------------------------------------- static checks

def _check_pads(at):
    if at.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID", b"SAME_UPPER", "SAME_UPPER",
                                              b"SAME_LOWER", "SAME_LOWER"):
        return f"auto_pad={at['auto_pad']!r}"


def _check_pool(at):
    if at.get("storage_order", 0) != 0:
        return "storage_order=1"
    return _check_pads(at)


def _check_avg(at):
    if at.get("ceil_mode", 0) and at.get("count_include_pad", 0):
        return "ceil_mode=1 with count_include_pad=1"
    if at.get("dilations") and any(d != 1 for d in at["dilations"]):
        return f"dilations={list(at['dilations'])}"
    return _check_pool(at)


def _check_gelu(at):
    a = at.get("approximate", b"none")
    a = a.decode() if isinstance(a, bytes) else a
    return None if a in ("none", "tanh") else f"approximate={a!r}"


def _check_bn(at):
    return "training_mode=1" if at.get("training_mode", 0) else None


def _check_cast(at):
    return None if at.get("to") in (FLOAT, INT32, INT64, BOOL) else f"to={at.get('to')} (only float32, int32, int64, bool)"


def _check_constant(at):
    for k in ("sparse_value", "value_string", "value_strings"):
        if k in at:
            return k
    return None


def _check_reduce(at):
    return None


CHECKS: dict[str, Callable[[dict], str | None]] = {
    "Conv": _check_pads, "MaxPool": _check_pool, "AveragePool": _check_avg, "Gelu": _check_gelu,
    "BatchNormalization": _check_bn, "Cast": _check_cast, "Constant": _check_constant,
}
