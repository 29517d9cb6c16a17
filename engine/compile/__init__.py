"""From a graph to an ``ExecutionPlan``: the whole step as plain data.

``plan`` schedules dispatches, reuses buffers by liveness and places parameter groups
and the optimizer step; ``cache`` keeps compiled plans on disk. Imports
``engine.graph`` and ``engine.codegen`` (each dispatch's kernel); the runtime only
executes what comes out.
"""

from .cache import cached_plan, default_cache_dir
from .plan import ALIGN, ExecutionPlan, OptimizerSpec, compile_plan

__all__ = ["ExecutionPlan", "OptimizerSpec", "compile_plan", "cached_plan", "default_cache_dir", "ALIGN"]
