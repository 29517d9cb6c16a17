"""A small Module API: models as trees of modules that hold named parameters.

A ``Module`` keeps its ``Parameter`` attributes and child modules; their names
follow the attribute path from the root (``encoder.layers.0.fc1.weight``), the
way PyTorch's ``state_dict`` names them, so weights files bind by name. A
module's forward takes a ``Graph`` and node ids and returns a node id; it
declares its parameters into the graph under their full names and reuses a
parameter the graph already has. Calling a module stamps the nodes its forward
builds with its path (``Graph.scope``), so profiles and the graph view can name
and group them by module. One model therefore builds several graphs (a
training graph at batch B, an inference graph at batch 1) over the same
parameter names, and one parameter dict feeds them all.

Each parameter carries an init spec, a plain dict such as
``{"kind": "normal", "std": 0.02}`` (JSON-friendly: it is stored in the graph's
``param_meta``). ``initialize(spec, shape, rng)`` turns it into an array;
``Module.init_params(seed)`` does it for the whole tree, with one random stream
per parameter name so the values do not depend on declaration order.

``capture(g, name, x)`` marks an intermediate as a graph output named
``capture:NAME`` so it can be read back after a run (the GUI's activation view);
``read_captures(outputs)`` picks them out of a result dict.
"""

from __future__ import annotations

import math
import zlib
from typing import Iterator, Mapping, Sequence

import numpy as np

from ..errors import GraphError, MeganeuraError, ShapeError
from .ir import Graph
from .kv_cache import rotary, self_attention

CAPTURE_PREFIX = "capture:"


# ---------------------------------------------------------------- init specs

def zeros() -> dict:
    return {"kind": "zeros"}


def ones() -> dict:
    return {"kind": "ones"}


def normal(std: float, mean: float = 0.0) -> dict:
    return {"kind": "normal", "std": float(std), "mean": float(mean)}


def uniform(low: float, high: float) -> dict:
    return {"kind": "uniform", "low": float(low), "high": float(high)}


def kaiming(fan_in: int, gain: float = math.sqrt(2.0)) -> dict:
    """He initialisation: normal with std gain/sqrt(fan_in) (gain sqrt(2) suits ReLU)."""
    return {"kind": "kaiming", "fan_in": int(fan_in), "gain": float(gain)}


def xavier(fan_in: int, fan_out: int, gain: float = 1.0) -> dict:
    """Glorot initialisation: uniform in ±gain*sqrt(6/(fan_in+fan_out))."""
    return {"kind": "xavier", "fan_in": int(fan_in), "fan_out": int(fan_out), "gain": float(gain)}


def sinusoidal(base: float = 10000.0) -> dict:
    """Fixed sin/cos position table [positions, channels] (Whisper's embed_positions):
    first half sin, second half cos, timescales from 1 to ``base``."""
    return {"kind": "sinusoidal", "base": float(base)}


def _draw_zeros(spec, shape, rng):
    return np.zeros(shape)


def _draw_ones(spec, shape, rng):
    return np.ones(shape)


def _draw_normal(spec, shape, rng):
    return rng.normal(spec.get("mean", 0.0), spec["std"], shape)


def _draw_uniform(spec, shape, rng):
    return rng.uniform(spec["low"], spec["high"], shape)


def _draw_kaiming(spec, shape, rng):
    return rng.normal(0.0, spec.get("gain", math.sqrt(2.0)) / math.sqrt(spec["fan_in"]), shape)


def _draw_xavier(spec, shape, rng):
    bound = spec.get("gain", 1.0) * math.sqrt(6.0 / (spec["fan_in"] + spec["fan_out"]))
    return rng.uniform(-bound, bound, shape)


def _draw_sinusoidal(spec, shape, rng):
    length, channels = shape
    half = channels // 2
    increment = math.log(spec.get("base", 10000.0)) / max(half - 1, 1)
    inv_timescales = np.exp(-increment * np.arange(half))
    angles = np.arange(length)[:, None] * inv_timescales[None, :]
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)


INITIALIZERS = {
    "zeros": _draw_zeros, "ones": _draw_ones, "normal": _draw_normal,
    "uniform": _draw_uniform, "kaiming": _draw_kaiming, "xavier": _draw_xavier,
    "sinusoidal": _draw_sinusoidal,
}


def initialize(spec: Mapping, shape: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """A float32 array of ``shape`` drawn as ``spec`` says."""
    kind = spec.get("kind", "zeros") if spec else "zeros"
    if kind not in INITIALIZERS:
        raise MeganeuraError(f"unknown init kind {kind!r}; known: {', '.join(INITIALIZERS)}")
    return np.asarray(INITIALIZERS[kind](spec, tuple(shape), rng), dtype=np.float32)


def param_rng(seed: int, name: str) -> np.random.Generator:
    """One random stream per (seed, parameter name): values do not depend on order."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode())])


def init_graph_params(graph: Graph, seed: int) -> dict[str, np.ndarray]:
    """Initial values for every parameter of a graph, from the specs in its param_meta.
    Gives the same values as ``Module.init_params`` for the module that built it."""
    return {name: initialize(graph.param_meta[name]["init"], graph.shape(nid), param_rng(seed, name))
            for name, nid in graph.parameters.items()}


# ---------------------------------------------------------------- parameters and modules

class Parameter:
    """A learned tensor of a module: shape, init spec, trainable flag, weight decay flag.

    Its name is the attribute path from the root module, known once it is attached."""

    def __init__(self, shape: Sequence[int], init: Mapping | None = None,
                 trainable: bool = True, decay: bool | None = None):
        self.shape = tuple(int(n) for n in shape)
        self.init = dict(init or zeros())
        self.trainable = trainable
        self.decay = len(self.shape) >= 2 if decay is None else decay
        self._owner: tuple[Module, str] | None = None

    @property
    def name(self) -> str:
        if self._owner is None:
            raise MeganeuraError("parameter is not attached to a module, so it has no name")
        module, attr = self._owner
        return _join(module.path, attr)

    def node(self, g: Graph) -> int:
        """This parameter's node in ``g``: declared on first use, reused afterwards."""
        name = self.name
        if name in g.parameters:
            nid = g.parameters[name]
            if g.shape(nid) != self.shape:
                raise ShapeError(f"parameter {name!r}: graph {g.name!r} has it as {list(g.shape(nid))}, "
                                 f"the module declares {list(self.shape)}")
            return nid
        with g.scope(self._owner[0].path):     # the module that owns it, whoever reads it first
            return g.parameter(name, self.shape, init=self.init, trainable=self.trainable, decay=self.decay)

    def __repr__(self):
        owner = self.name if self._owner else "unattached"
        return f"Parameter({owner}, {list(self.shape)}, {self.init.get('kind')})"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class Module:
    """Base class: parameters and child modules are found by attribute.

    A child keeps the first place it was attached (so a module or parameter shared
    between two places, like a tied embedding, has one name). Subclasses define
    ``forward(g, *nodes, **options) -> node``; call the module to run it."""

    _owner: tuple["Module", str] | None = None

    def __setattr__(self, key, value):
        if isinstance(value, list) and value and all(isinstance(v, Module) for v in value):
            value = ModuleList(value)
        if isinstance(value, (Module, Parameter)) and value._owner is None and value is not self:
            value._owner = (self, key)
        object.__setattr__(self, key, value)

    @property
    def path(self) -> str:
        """The attribute path from the root ('' for the root itself)."""
        if self._owner is None:
            return ""
        parent, attr = self._owner
        return _join(parent.path, attr)

    def _children(self) -> Iterator[tuple[str, object]]:
        yield from vars(self).items()

    def named_parameters(self) -> dict[str, Parameter]:
        """Every parameter under this module by full name, in declaration order."""
        out: dict[str, Parameter] = {}
        seen: set[int] = set()
        self._collect(out, seen)
        return out

    def _collect(self, out: dict, seen: set):
        for _, value in self._children():
            if id(value) in seen:
                continue
            if isinstance(value, Parameter):
                seen.add(id(value))
                out[value.name] = value
            elif isinstance(value, Module):
                seen.add(id(value))
                value._collect(out, seen)

    def modules(self) -> Iterator["Module"]:
        """This module and every module under it, depth first."""
        yield self
        for _, value in self._children():
            if isinstance(value, Module) and value._owner is not None and value._owner[0] is self:
                yield from value.modules()

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: p.shape for name, p in self.named_parameters().items()}

    def init_params(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Fresh values for every parameter, deterministic in ``seed``."""
        return {name: initialize(p.init, p.shape, param_rng(seed, name))
                for name, p in self.named_parameters().items()}

    def reset(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Re-initialise: the same as ``init_params`` (modules hold specs, not values)."""
        return self.init_params(seed)

    def weight_transposes(self) -> set[str]:
        """Names of weights that files store transposed (HF Linear layout [out, in])."""
        return {name for m in self.modules() for name in m._own_transposes()}

    def _own_transposes(self) -> set[str]:
        return set()

    def freeze(self) -> "Module":
        """Mark every parameter under this module as not trainable (no gradient)."""
        for p in self.named_parameters().values():
            p.trainable = False
        return self

    def forward(self, g: Graph, *args, **kwargs) -> int:
        raise NotImplementedError(f"{type(self).__name__} has no forward")

    def __call__(self, g: Graph, *args, **kwargs) -> int:
        """Run ``forward`` with the nodes it builds stamped with this module's path."""
        with g.scope(self.path):
            return self.forward(g, *args, **kwargs)


class ModuleList(Module):
    """An indexable list of modules; children are named by their index."""

    def __init__(self, modules: Sequence[Module] = ()):
        object.__setattr__(self, "_items", [])
        for m in modules:
            self.append(m)

    def append(self, module: Module):
        if not isinstance(module, Module):
            raise GraphError(f"ModuleList holds modules, found {type(module).__name__}")
        if module._owner is None:
            module._owner = (self, str(len(self._items)))
        self._items.append(module)

    def _children(self):
        return ((str(i), m) for i, m in enumerate(self._items))

    def __getitem__(self, i) -> Module:
        return self._items[i]

    def __len__(self):
        return len(self._items)

    def __iter__(self):
        return iter(self._items)


class Container(Module):
    """A module that only groups others under a name (e.g. ``model.encoder``)."""

    def __init__(self, **children):
        for key, value in children.items():
            setattr(self, key, value)


# ---------------------------------------------------------------- layers

class Linear(Module):
    """y = x @ weight (+ bias), weight stored [in, out] in the graph.

    ``transpose_on_load`` (default): weights files store it [out, in], PyTorch's and
    HuggingFace's layout, so their state dicts load as they are."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 init: Mapping | None = None, transpose_on_load: bool = True):
        self.in_features, self.out_features = in_features, out_features
        self.transpose_on_load = transpose_on_load
        self.weight = Parameter((in_features, out_features), init or xavier(in_features, out_features))
        if bias:
            self.bias = Parameter((out_features,), zeros(), decay=False)
        else:
            self.bias = None

    def _own_transposes(self):
        return {self.weight.name} if self.transpose_on_load else set()

    def forward(self, g, x):
        return g.linear(x, self.weight.node(g), None if self.bias is None else self.bias.node(g))


class Embedding(Module):
    """Rows of a [num, dim] table picked by i32 ids."""

    def __init__(self, num: int, dim: int, init: Mapping | None = None):
        self.weight = Parameter((num, dim), init or normal(0.02), decay=False)

    def forward(self, g, ids):
        return g.embedding(self.weight.node(g), ids)


class LayerNorm(Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        self.eps = eps
        self.weight = Parameter((dim,), ones(), decay=False)
        self.bias = Parameter((dim,), zeros(), decay=False)

    def forward(self, g, x):
        return g.layer_norm(x, self.weight.node(g), self.bias.node(g), self.eps)


class RMSNorm(Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        self.eps = eps
        self.weight = Parameter((dim,), ones(), decay=False)

    def forward(self, g, x):
        return g.rms_norm(x, self.weight.node(g), self.eps)


class _ConvNd(Module):
    ndim = 1

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True,
                 init: Mapping | None = None):
        ks = (kernel_size,) * self.ndim if isinstance(kernel_size, int) else tuple(kernel_size)
        self.stride, self.padding = stride, padding
        fan_in = in_channels * math.prod(ks)
        self.weight = Parameter((out_channels, in_channels, *ks), init or kaiming(fan_in))
        self.bias = Parameter((out_channels,), zeros(), decay=False) if bias else None

    def forward(self, g, x):
        conv = g.conv1d if self.ndim == 1 else g.conv2d
        bias = None if self.bias is None else self.bias.node(g)
        return conv(x, self.weight.node(g), bias, stride=self.stride, padding=self.padding)


class Conv1d(_ConvNd):
    """x [N, C, L] -> [N, O, L']; weight [O, C, K] (PyTorch layout, no transpose on load)."""
    ndim = 1


class Conv2d(_ConvNd):
    """x [N, C, H, W] -> [N, O, H', W']; weight [O, C, KH, KW]."""
    ndim = 2


class MultiHeadAttention(Module):
    """Self-attention on [batch, seq, dim]: q/k/v projections, attention, out projection.

    ``num_kv_heads`` < ``num_heads`` gives grouped-query attention; ``k_bias=False``
    drops the key bias (Whisper); ``rope`` rotates q and k (rotate-half form)."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None, bias: bool = True,
                 k_bias: bool | None = None, causal: bool = False, rope: bool = False,
                 rope_base: float = 10000.0, init: Mapping | None = None,
                 out_init: Mapping | None = None, transpose_on_load: bool = True):
        if dim % num_heads:
            raise ShapeError(f"attention width {dim} does not split into {num_heads} heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.causal, self.rope, self.rope_base = causal, rope, rope_base
        kv_dim = dim // num_heads * self.num_kv_heads
        k_bias = bias if k_bias is None else k_bias
        lin = dict(init=init, transpose_on_load=transpose_on_load)
        self.q_proj = Linear(dim, dim, bias, **lin)
        self.k_proj = Linear(dim, kv_dim, k_bias, **lin)
        self.v_proj = Linear(dim, kv_dim, bias, **lin)
        self.out_proj = Linear(dim, dim, bias, init=out_init or init, transpose_on_load=transpose_on_load)

    def forward(self, g, x):
        q, k, v = self.q_proj(g, x), self.k_proj(g, x), self.v_proj(g, x)
        if self.rope:
            q = rotary(g, q, self.num_heads, self.rope_base)
            k = rotary(g, k, self.num_kv_heads, self.rope_base)
        if self.causal:
            o = self_attention(g, q, k, v, self.num_heads, self.num_kv_heads)
        else:
            o = g.attention(q, k, v, self.num_heads, num_kv_heads=self.num_kv_heads)
        return self.out_proj(g, o)


ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")


def activate(g: Graph, x: int, activation: str) -> int:
    if activation == "relu":
        return g.relu(x)
    if activation == "gelu":
        return g.gelu(x)
    if activation == "gelu_tanh":
        return g.gelu(x, approximate="tanh")
    if activation == "silu":
        return g.silu(x)
    raise MeganeuraError(f"unknown activation {activation!r}; known: {', '.join(ACTIVATIONS)}")


class MLP(Module):
    """fc2(act(fc1(x))): two Linear layers named fc1 and fc2."""

    def __init__(self, dim: int, hidden: int, out: int | None = None, activation: str = "gelu",
                 bias: bool = True, init: Mapping | None = None, out_init: Mapping | None = None,
                 transpose_on_load: bool = True):
        if activation not in ACTIVATIONS:
            raise MeganeuraError(f"unknown activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
        self.activation = activation
        self.fc1 = Linear(dim, hidden, bias, init=init, transpose_on_load=transpose_on_load)
        self.fc2 = Linear(hidden, out or dim, bias, init=out_init or init, transpose_on_load=transpose_on_load)

    def forward(self, g, x):
        return self.fc2(g, activate(g, self.fc1(g, x), self.activation))


# ---------------------------------------------------------------- captures

def capture(g: Graph, name: str, x: int) -> int:
    """Expose ``x`` as the graph output ``capture:NAME``; returns ``x`` unchanged."""
    g.output(CAPTURE_PREFIX + name, x)
    return x


def capture_names(g: Graph) -> list[str]:
    return [k[len(CAPTURE_PREFIX):] for k in g.outputs if k.startswith(CAPTURE_PREFIX)]


def read_captures(outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The captured intermediates of a run's outputs, by capture name."""
    return {k[len(CAPTURE_PREFIX):]: v for k, v in outputs.items() if k.startswith(CAPTURE_PREFIX)}
