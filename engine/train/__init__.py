"""Training: configuration, optimizers, data, history, the GPU training session and the
``Trainer`` loop.

``config`` and ``optimizers`` are pure numpy; ``session`` builds a training session
(optimize, differentiate, optimize, compile, run); ``trainer`` drives either backend;
``run`` is a Trainer on a model's data that writes a run directory (``run_dir``:
config, metrics, status, checkpoints) and resumes one.
Imports the stages below it; nothing below imports it.
"""

from .config import OPTIMIZERS, SCHEDULES, TrainConfig, clip_by_global_norm, learning_rate
from .data import DataLoader
from .history import LossHistory, TrainHistory
from .optimizers import Optimizer, adam_update, sgd_update
from .run import RunOptions, TrainingRun
from .run_dir import RunDirectory
from .runs import RunSummary, debiased_ema, list_runs, read_metrics
from .session import TrainingSession, build_session
from .trainer import BACKENDS, Trainer

__all__ = ["TrainConfig", "OPTIMIZERS", "SCHEDULES", "learning_rate", "clip_by_global_norm", "DataLoader",
           "LossHistory", "TrainHistory", "Optimizer", "adam_update", "sgd_update", "TrainingSession",
           "build_session", "BACKENDS", "Trainer", "TrainingRun", "RunOptions", "RunDirectory", "RunSummary", "list_runs", "read_metrics", "debiased_ema"]
