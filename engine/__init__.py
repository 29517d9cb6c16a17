"""Meganeura's engine: graph IR, fusion, autodiff, compilation and the wgpu runtime.

Never imports Qt: everything the Studio shows comes from objects this package
builds, so tests and the command line get them without a window.
"""

from .version import __version__

from .errors import MeganeuraError, TrainingError
from .graph.ir import Graph, Node
from .graph.ops import OPS
from .autodiff.gradients import GRADIENTS, differentiate
from .compile.plan import ExecutionPlan, compile_plan
from .train.data import DataLoader
from .train.history import LossHistory, TrainHistory
from .train.optimizers import Optimizer
from .train.config import TrainConfig
from .train.trainer import Trainer
from . import models
from .importers import load_model
from .graph import nn
from .data import audio

__all__ = ["Graph", "Node", "OPS", "MeganeuraError", "TrainingError", "GRADIENTS", "differentiate",
           "ExecutionPlan", "compile_plan", "DataLoader", "LossHistory", "Optimizer", "TrainConfig",
           "Trainer", "TrainHistory", "models", "nn", "audio", "load_model", "build_session",
           "build_inference_session", "Session", "__version__"]

# The runtime and the training session (and through them egglog) load on first use, so that `import engine` (every
# `meganeura` command) stays quick.
_LAZY = {"build_session": ("train.session", "build_session"),
         "build_inference_session": ("runtime.session", "build_inference_session"),
         "Session": ("runtime.session", "Session")}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
