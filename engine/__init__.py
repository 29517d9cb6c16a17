"""Meganeura's engine: graph IR, fusion, autodiff, compilation and the wgpu runtime.

Never imports Qt: everything the Studio shows comes from objects this package
builds, so tests and the command line get them without a window.
"""

__version__ = "0.1.0"

from .errors import MeganeuraError, TrainingError
from .graph import Graph, Node
from .ops import OPS
from .autodiff import GRADIENTS, differentiate
from .compile import ExecutionPlan, compile_plan
from .train import DataLoader, LossHistory, Optimizer, TrainConfig, Trainer, TrainHistory
from . import models, nn, audio

__all__ = ["Graph", "Node", "OPS", "MeganeuraError", "TrainingError", "GRADIENTS", "differentiate",
           "ExecutionPlan", "compile_plan", "DataLoader", "LossHistory", "Optimizer", "TrainConfig",
           "Trainer", "TrainHistory", "models", "nn", "audio", "__version__"]
