"""``OnnxModel`` (the built-in models' interface over an ONNX graph) and ``load_onnx``: read the file,
refuse what is not handled in one error, bind the symbolic dimensions, build once.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import MeganeuraError, ModelImportError
from ...graph import nn
from ...graph.ir import Graph
from ...graph.modules import ancestors
from ...models.base import BuiltinModel, Setting, positive
from .checks import CHECKS, GRAPH_TYPES, MIN_OPSET, Refused, _attrs
from .translate import BOOL_OPS, CONST_SLOTS, INDEX_SLOTS, TRANSLATE, UNARY_FOLD, _np_tensor, module_of
from .values import Ctx


# ---------------------------------------------------------------- the model

def _dims(vi) -> list:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    return [d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else "?")
            for d in t.shape.dim]


class OnnxModel(BuiltinModel):
    """An ONNX file's graph with the built-in models' interface."""

    name = "onnx"
    description = "an imported ONNX model"
    SETTINGS: dict[str, Setting] = {}
    TRAIN_DEFAULTS = {"optimizer": "adamw", "lr": 1e-3}

    # set by load_onnx on the per-file subclass
    path: Path
    proto: Any = None
    loss: str | None = None
    target: str | None = None

    def make_module(self):
        return nn.Module()

    def check_settings(self):
        unbound = [k for k, v in self.settings.items() if v == 0]
        if unbound:
            raise ModelImportError(
                f"{self.path}: symbolic dimension(s) {', '.join(unbound)} have no value; give each with "
                + " ".join(f"--set {k}=VALUE" for k in unbound))

    # ------------------------------------------------------------ interface

    def _bind(self, dims, batch=None):
        out = []
        for i, d in enumerate(dims):
            if isinstance(d, str):
                if d == "?" or d == "":
                    raise ModelImportError(f"{self.path}: an input has a dimension with no size or name")
                out.append(batch if batch and i == 0 and d == self._batch_dim else int(self.settings[d]))
            else:
                out.append(int(d))
        return tuple(out)

    @property
    def _batch_dim(self):
        for name in self._inputs:
            dims = self._inputs[name][0]
            if dims and isinstance(dims[0], str):
                return dims[0]
        return None

    def input_shapes(self, batch=None) -> dict[str, tuple[tuple[int, ...], str]]:
        return {n: (self._bind(d, batch), dt) for n, (d, dt) in self._inputs.items()}

    def input_names(self, train: bool) -> list[str]:
        return list(self._inputs) + (["targets"] if train else [])

    def parameter_shapes(self):
        return {k: tuple(v.shape) for k, v in self._params.items()}

    def init_params(self, seed: int = 0):
        return {k: v.copy() for k, v in self._params.items()}

    def reset(self, seed: int = 0):
        return self.init_params(seed)

    @property
    def weight_transposes(self):
        return set()

    @property
    def cannot_train(self) -> str | None:
        if self.loss and self.target:
            return None
        return (f"{self.path.name} declares no loss: training an ONNX model needs one (mse or cross-entropy) on "
                f"one of its outputs ({', '.join(self._outputs)})")

    def build(self, train: bool = False, batch: int | None = None, capture: bool = False) -> Graph:
        if train and self.cannot_train:
            raise MeganeuraError(f"{self.path}: training an ONNX model needs a loss and the output it applies to: "
                                 f"give --loss mse|cross-entropy --target OUTPUT (outputs: {', '.join(self._outputs)})")
        g = Graph(f"{self.path.stem}-{'train' if train else 'infer'}")
        ctx = Ctx(g)
        graph = self.proto.graph
        for name, (dims, dt) in self._inputs.items():
            ctx.env[name] = g.input(name, self._bind(dims, batch), dt)
        for name, arr in self._params.items():
            ctx.env[name] = g.parameter(name, arr.shape, trainable=name not in self._frozen)
        for name, arr in self._consts.items():
            ctx.env[name] = arr
        for node in graph.node:
            where = f"node {node.name or '(unnamed)'!r} ({node.op_type})"
            try:
                xs = [ctx.env[i] if i else None for i in node.input]
                if node.op_type in UNARY_FOLD and isinstance(xs[0], np.ndarray):
                    outs = [UNARY_FOLD[node.op_type](xs[0])]
                else:
                    with g.scope(module_of(node)):
                        outs = TRANSLATE[node.op_type](ctx, node, _attrs(node), xs)
            except Refused as e:
                raise ModelImportError(f"{self.path}: {where}: {e}") from None
            except MeganeuraError as e:
                raise ModelImportError(f"{self.path}: {where}: {e}") from None
            except (ValueError, TypeError, IndexError, KeyError, ArithmeticError) as e:
                raise ModelImportError(f"{self.path}: {where} cannot be translated: {type(e).__name__}: {e}") from None
            for name, v in zip(node.output, outs):
                if isinstance(v, np.generic):  # numpy folds 0-d results to scalars
                    v = np.asarray(v)
                if name:
                    ctx.env[name] = v
                    if node.op_type in BOOL_OPS or (isinstance(v, np.ndarray) and v.dtype == bool):
                        ctx.bool.add(name)
            if node.op_type == "Where" and node.input[1] in ctx.bool:
                ctx.bool.add(node.output[0])
        try:
            for name in self._outputs:
                if name in ctx.bool:
                    raise Refused(f"output {name!r} is boolean (only float32 and integer outputs are supported)")
                v = ctx.env[name]
                if isinstance(v, np.ndarray):
                    v = ctx.node(v)
                want = self._outputs[name][1]
                if g[v].dtype != want:
                    raise Refused(f"output {name!r} is {g[v].dtype}, the file declares {want}")
                g.output(name, v)
            if train:
                out = g.outputs[self.target]
                if self.loss == "mse":
                    t = g.input("targets", g.shape(out), "f32")
                    g.output("loss", g.mse_loss(out, t))
                else:
                    if not g.shape(out):
                        raise Refused(f"cross-entropy needs a class axis on output {self.target!r}")
                    t = g.input("targets", g.shape(out)[:-1], "i32")
                    g.output("loss", g.cross_entropy_loss(out, t))
        except Refused as e:
            raise ModelImportError(f"{self.path}: {e}") from None
        except MeganeuraError as e:
            raise ModelImportError(f"{self.path}: {e}") from None
        _place_parameters(g)
        empty = [n for n in g.nodes if 0 in n.shape]
        if empty:
            raise ModelImportError(f"{self.path}: {g.format_node(empty[0])} is an empty tensor; "
                                   f"zero-size tensors are not supported")
        return g

    def example_inputs(self, batch: int | None = None, train: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        out = {}
        for name, (shape, dt) in self.input_shapes(batch).items():
            if dt == "f32":
                out[name] = rng.standard_normal(shape).astype(np.float32)
            else:
                out[name] = rng.integers(0, self._id_limit.get(name, 10), shape).astype(np.int32)
        if train:
            g = self.build(train=True, batch=batch)
            node = g[g.inputs["targets"]]
            if node.dtype == "f32":
                out["targets"] = rng.standard_normal(node.shape).astype(np.float32)
            else:
                classes = g.shape(g.outputs[self.target])[-1]
                out["targets"] = rng.integers(0, classes, node.shape).astype(np.int32)
        return out

    def dataset(self, seed: int = 0) -> dict[str, np.ndarray]:
        return self.example_inputs(None, train=bool(self.loss and self.target), seed=seed)

    def summary(self) -> dict:
        shapes = self.input_shapes()
        g = self.build(train=False)
        return {
            "name": self.name,
            "inputs": [{"name": n, "shape": list(s), "dtype": dt} for n, (s, dt) in shapes.items()],
            "outputs": [{"name": n, "shape": list(g.shape(i)), "dtype": g[i].dtype} for n, i in g.outputs.items()],
            "parameters": int(sum(v.size for v in self._params.values())),
            "parameter_bytes": int(sum(v.nbytes for v in self._params.values())),
            "ops": dict(Counter(n.op_type for n in self.proto.graph.node)),
        }


# ---------------------------------------------------------------- loading

def _place_parameters(g: Graph) -> None:
    """An initializer belongs to the module its name says (``layers.0.fc1.weight``) when the
    graph has that module, else to the module of its first reader."""
    known = {m for n in g.nodes for m in n.modules}
    known |= {a for m in known for a in ancestors(m)}
    users = g.users()
    for name, nid in g.parameters.items():
        owner = name.rpartition(".")[0]
        if not owner or owner not in known:
            owner = g[users[nid][0]].module if users[nid] else ""
        g.set_modules(nid, owner)


def _read(path: Path):
    import onnx
    from google.protobuf.message import DecodeError
    if not path.is_file():
        raise ModelImportError(f"{path}: no such ONNX file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ModelImportError(f"{path}: cannot read: {e}") from None
    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError, TypeError, UnicodeDecodeError) as e:
        raise ModelImportError(f"{path}: not an ONNX model, or a truncated one ({type(e).__name__}: {e})") from None
    except Exception as e:  # protobuf raises assorted errors on garbage
        raise ModelImportError(f"{path}: not an ONNX model, or a truncated one ({type(e).__name__}: {e})") from None
    if model.ir_version <= 0 or not model.HasField("graph") or not model.graph.node and not model.graph.output:
        raise ModelImportError(f"{path}: not an ONNX model (no graph), or a truncated one")
    try:
        from onnx.external_data_helper import load_external_data_for_model, uses_external_data
        if any(uses_external_data(t) for t in model.graph.initializer):
            load_external_data_for_model(model, str(path.parent))
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelImportError(f"{path}: cannot read its external data: {e}") from None
    try:
        onnx.checker.check_model(model)
    except Exception as e:  # onnx.checker.ValidationError and friends
        if "2GB" not in str(e):
            raise ModelImportError(f"{path}: not a valid ONNX model: {str(e).splitlines()[0] if str(e) else e}") from None
    if model.functions:
        try:
            from onnx import inliner
            model = inliner.inline_local_functions(model)
        except Exception as e:
            raise ModelImportError(f"{path}: cannot inline its local functions: {e}") from None
    return model


def load_onnx(path: Path, settings: dict[str, str], loss: str | None = None,
              target: str | None = None, default_dims: int | None = None) -> OnnxModel:
    """The model in ``path``; its symbolic dimensions take their values from ``settings``,
    else ``default_dims`` (the Studio, which shows them as editable settings), else an
    error names them."""
    path = Path(path)
    model = _read(path)
    graph = model.graph
    opset = {(o.domain or "ai.onnx"): o.version for o in model.opset_import}
    version = opset.get("ai.onnx")
    if version is None:
        raise ModelImportError(f"{path}: the model imports no standard ONNX opset")
    if version < MIN_OPSET:
        raise ModelImportError(f"{path}: opset {version} is older than {MIN_OPSET}, the oldest supported; "
                               f"convert it with onnx.version_converter.convert_version(model, {MIN_OPSET})")

    # ---- every unsupported op or attribute, in one error
    bad: dict[str, list[str]] = {}
    for i, node in enumerate(graph.node):
        label = node.name or f"#{i}"
        if node.domain not in ("", "ai.onnx"):
            bad.setdefault(f"{node.domain}::{node.op_type}", []).append(label)
            continue
        if node.op_type not in TRANSLATE:
            bad.setdefault(node.op_type, []).append(label)
            continue
        try:
            problem = CHECKS.get(node.op_type, lambda a: None)(_attrs(node))
        except Refused as e:
            problem = str(e)
        if problem:
            bad.setdefault(f"{node.op_type} ({problem})", []).append(label)
    if bad:
        parts = [f"{op} ({len(names)} node{'s' if len(names) > 1 else ''}: {', '.join(names[:5])}"
                 + (", ..." if len(names) > 5 else "") + ")" for op, names in sorted(bad.items())]
        raise ModelImportError(f"{path}: {len(parts)} ONNX op{'s' if len(parts) > 1 else ''} this importer does "
                               f"not handle (opset {version}): " + "; ".join(parts))

    # ---- initializers: float ones are parameters, integer ones (and float ones read as constants) constants
    const_reads: set[str] = set()
    frozen: set[str] = set()
    for node in graph.node:
        for slot in CONST_SLOTS.get(node.op_type, ()):
            if slot < len(node.input) and node.input[slot]:
                const_reads.add(node.input[slot])
        if node.op_type == "BatchNormalization":
            frozen.update(node.input[3:5])
    params, consts = {}, {}
    for t in graph.initializer:
        try:
            arr = _np_tensor(t)
        except Refused as e:
            raise ModelImportError(f"{path}: initializer {t.name!r}: {e}") from None
        if arr.dtype == np.float32 and t.name not in const_reads:
            params[t.name] = arr
        else:
            consts[t.name] = arr
    if graph.sparse_initializer:
        raise ModelImportError(f"{path}: sparse initializers are not supported")

    # ---- inputs, outputs and symbolic dimensions
    inputs, outputs, symbols = {}, {}, {}
    for vi in graph.input:
        if vi.name in params or vi.name in consts:
            continue
        if not vi.type.HasField("tensor_type"):
            raise ModelImportError(f"{path}: input {vi.name!r} is not a tensor")
        et = vi.type.tensor_type.elem_type
        if et not in GRAPH_TYPES:
            raise ModelImportError(f"{path}: input {vi.name!r} has element type {_type_name(et)}; "
                                   f"only float32, int32 and int64 inputs are supported")
        dims = _dims(vi)
        if dims is None:
            raise ModelImportError(f"{path}: input {vi.name!r} has no declared shape")
        for d in dims:
            if isinstance(d, str):
                if d in ("?", ""):
                    raise ModelImportError(f"{path}: input {vi.name!r} has a dimension with neither size nor name")
                symbols.setdefault(d, vi.name)
        inputs[vi.name] = (dims, GRAPH_TYPES[et])
    for vi in graph.output:
        et = vi.type.tensor_type.elem_type
        if et not in GRAPH_TYPES:
            raise ModelImportError(f"{path}: output {vi.name!r} has element type {_type_name(et)}; "
                                   f"only float32, int32 and int64 outputs are supported")
        outputs[vi.name] = (_dims(vi), GRAPH_TYPES[et])
    if loss is not None or target is not None:
        if loss not in ("mse", "cross-entropy") or target not in outputs:
            raise ModelImportError(f"{path}: training needs --loss mse|cross-entropy --target OUTPUT with OUTPUT one "
                                   f"of {', '.join(outputs)}; found loss={loss!r}, target={target!r}")
    missing = [s for s in symbols if s not in settings]
    if missing and default_dims:
        settings = {**{s: str(default_dims) for s in missing}, **settings}
        missing = []
    if missing:
        raise ModelImportError(f"{path}: symbolic dimension(s) {', '.join(missing)} (of input(s) "
                               f"{', '.join(symbols[s] for s in missing)}) need a value: give "
                               + " ".join(f"--set {s}=VALUE" for s in missing))

    # ---- ids for integer inputs that index a table
    id_limit: dict[str, int] = {}
    shapes = {k: v.shape for k, v in {**params, **consts}.items()}
    for node in graph.node:
        if node.op_type in INDEX_SLOTS and len(node.input) > 1 and node.input[1] in inputs:
            table = node.input[0]
            if table in shapes and shapes[table]:
                at = {a.name: a.i for a in node.attribute}
                axis = at.get("axis", 0)
                n = shapes[table][axis]
                id_limit[node.input[1]] = min(id_limit.get(node.input[1], n), n)

    cls = type(f"OnnxModel_{path.stem}", (OnnxModel,), {
        "name": path.stem,
        "description": f"ONNX model {path.name} (opset {version})",
        "SETTINGS": {s: Setting(0, f"symbolic dimension {s!r} of input {symbols[s]!r}", positive) for s in symbols},
        "path": path, "proto": model, "loss": loss, "target": target,
        "_inputs": inputs, "_outputs": outputs, "_params": params, "_consts": consts, "_frozen": frozen,
        "_id_limit": id_limit,
    })
    try:
        m = cls(**{k: v for k, v in settings.items()})
    except ModelImportError:
        raise
    except MeganeuraError as e:
        raise ModelImportError(f"{path}: {e}") from None
    m.build(train=False)  # every translation problem surfaces now
    if loss:
        m.build(train=True)
    return m


def _type_name(et: int) -> str:
    try:
        from onnx import TensorProto
        return TensorProto.DataType.Name(et)
    except ValueError:
        return str(et)


__all__ = ["OnnxModel", "load_onnx"]
