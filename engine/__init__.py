"""Meganeura's engine: graph IR, fusion, autodiff, compilation and the wgpu runtime.

Never imports Qt: everything the Studio shows comes from objects this package
builds, so tests and the command line get them without a window.
"""

__version__ = "0.1.0"

from .errors import MeganeuraError
from .graph import Graph, Node
from .ops import OPS


__all__ = ["Graph", "Node", "OPS", "MeganeuraError", "__version__"]
