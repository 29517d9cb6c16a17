"""Executing plans on a wgpu device, and measuring them.

``device`` (the adapter and device, the wgpu implementation, capabilities),
``session`` (``Session``: buffers, pipelines, one submit per step), ``dispatches``,
``report``, ``profiler`` (GPU timestamps per dispatch) and ``trace`` (Perfetto and
Chrome export). Imports ``engine.compile``, ``engine.codegen`` and ``engine.graph``;
the profiler never imports the session.
"""

from .device import adapter_summary, device_capabilities
from .report import ProfileReport
from .session import Session, build_inference_session

__all__ = ["Session", "build_inference_session", "device_capabilities", "adapter_summary", "ProfileReport"]
