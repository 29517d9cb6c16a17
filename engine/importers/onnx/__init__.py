"""

Modules: ``checks`` (what is refused up front), ``values`` (the translation context and
shared helpers), ``translate`` (one function per ONNX op type), ``model`` (``OnnxModel``,
``load_onnx``).
"""

from .model import OnnxModel, load_onnx

__all__ = ["OnnxModel", "load_onnx"]
