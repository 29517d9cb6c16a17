"""The GPU adapter and device (wgpu-py), and the versions of what we run on.

One device per process: ``get_device()`` creates it on first use and returns the
same object afterwards. ``adapter_info()`` describes the adapter wgpu chose
(``meganeura doctor`` prints it). No Qt here.
"""

from __future__ import annotations

from contextlib import contextmanager

import platform
import threading
from importlib import metadata

from .errors import DeviceError

# Features the engine can use when the adapter offers them. wgpu spells them in
# kebab-case; subgroups and cooperative matrices have had several names across
# wgpu-native releases, hence the loose matching in _interesting_features().
WANTED_FEATURES = ("timestamp-query", "timestamp-query-inside-passes", "shader-f16", "subgroup")
_INTERESTING_EXACT = ("timestamp-query", "timestamp-query-inside-passes", "shader-f16")
_INTERESTING_PREFIXES = ("subgroup", "cooperative-matri", "cooperative_matri", "coop-matri")

LIMIT_NAMES = (
    "max_storage_buffer_binding_size",
    "max_buffer_size",
    "max_compute_workgroup_storage_size",
    "max_compute_invocations_per_workgroup",
    "max_compute_workgroup_size_x",
    "max_compute_workgroups_per_dimension",
)

NO_ADAPTER_HELP = (
    "no GPU adapter found: wgpu saw neither a GPU nor a software renderer. "
    "On Debian/Ubuntu install the Vulkan drivers (software renderer included): "
    "sudo apt-get install mesa-vulkan-drivers libvulkan1 "
    "(or run scripts/setup.sh, which does it)"
)

_lock = threading.Lock()
_adapter = None
_device = None


def _wgpu():
    try:
        import wgpu
    except Exception as exc:  # ImportError, or the native library failing to load
        raise DeviceError(
            f"cannot load wgpu ({exc}); install the project with: pip install -e . "
            "(or run scripts/setup.sh)"
        ) from exc
    return wgpu


def get_adapter():
    """The adapter wgpu picks (a discrete GPU when there is one), cached."""
    global _adapter
    with _lock:
        if _adapter is None:
            wgpu = _wgpu()
            try:
                adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
            except Exception as exc:
                raise DeviceError(f"{NO_ADAPTER_HELP} [wgpu said: {exc}]") from exc
            if adapter is None:
                raise DeviceError(NO_ADAPTER_HELP)
            _adapter = adapter
        return _adapter


def _limit(limits, name: str):
    """A limit by snake_case name; wgpu-py reports them in kebab-case."""
    for key in (name.replace("_", "-"), name):
        if key in limits:
            return int(limits[key])
    return None


def _interesting_features(features) -> list[str]:
    found = set()
    for f in features:
        low = str(f).lower()
        if low in _INTERESTING_EXACT or low.startswith(_INTERESTING_PREFIXES):
            found.add(str(f))
    return sorted(found)


def _is_software(adapter_type: str, *names: str) -> bool:
    if adapter_type.lower() == "cpu":
        return True
    text = " ".join(names).lower()
    return any(word in text for word in ("llvmpipe", "lavapipe", "swiftshader", "software", "warp"))


def adapter_info(adapter=None) -> dict:
    """Plain-data description of the adapter (the default one unless given)."""
    adapter = adapter if adapter is not None else get_adapter()
    info = dict(adapter.info)
    name = info.get("device") or info.get("description") or info.get("vendor") or "unknown adapter"
    adapter_type = str(info.get("adapter_type", "unknown"))
    all_features = sorted(str(f) for f in adapter.features)
    limits = adapter.limits
    return {
        "name": str(name),
        "backend": str(info.get("backend_type", "unknown")),
        "adapter_type": adapter_type,
        "vendor": str(info.get("vendor", "")),
        "description": str(info.get("description", "")),
        "software": _is_software(adapter_type, str(name), str(info.get("vendor", ""))),
        "summary": str(adapter.summary),
        "features": _interesting_features(all_features),
        "all_features": all_features,
        "limits": {n: _limit(limits, n) for n in LIMIT_NAMES},
    }


def get_device():
    """The process-wide wgpu device, created on first call.

    Requests timestamp-query, shader-f16 and subgroup features where the adapter
    offers them, and the adapter's maximum buffer and workgroup-memory sizes (wgpu's
    defaults are much smaller: 128 MiB bindings, 256 MiB buffers, 16 KiB of workgroup
    memory). Not cooperative-matrix: wgpu-native 29 refuses every experimental feature
    ("experimental features are not enabled") and its C API has no switch for them.
    """
    global _device
    adapter = get_adapter()
    with _lock:
        if _device is None:
            offered = {str(f) for f in adapter.features}
            features = [f for f in WANTED_FEATURES if f in offered]
            limits = {}
            for name in ("max_storage_buffer_binding_size", "max_buffer_size",
                         "max_compute_workgroup_storage_size"):
                value = _limit(adapter.limits, name)
                if value is not None:
                    limits[name.replace("_", "-")] = value
            try:
                _device = adapter.request_device_sync(
                    label="meganeura", required_features=features, required_limits=limits
                )
            except Exception as exc:
                raise DeviceError(
                    f"could not create a device on {adapter.summary}: {exc}"
                ) from exc
        return _device


def forget_device(device) -> None:
    """Drop the process-wide device if it is ``device`` (it was lost): the next
    ``get_device()`` creates a new one."""
    global _device
    with _lock:
        if _device is device:
            _device = None


@contextmanager
def device_guard(what: str, device):
    """Turn wgpu's errors about a lost device ("Parent device is lost") into a
    DeviceError that says what happened and what to do, and forget that device."""
    try:
        yield
    except Exception as exc:
        if "device is lost" not in str(exc) and "device was lost" not in str(exc).lower():
            raise
        forget_device(device)
        raise DeviceError(
            f"the GPU device was lost while {what} (a driver reset, the GPU removed or out of "
            f"memory); its buffers, trained weights included, are gone: build a new session, and "
            f"save weights regularly during long runs") from None


# How naga guards generated kernels: "checked" (wgpu's default: every index clamped and
# every loop given a counter against infinite loops), "no-loop-bounding" (our loops all
# end: bounds checks only) or "unchecked" (neither: each kernel guards its own accesses).
SHADER_CHECKS = {"checked": None, "no-loop-bounding": 1, "unchecked": 0}


def shader_checks(guarded: bool = False) -> str:
    """The runtime checks compiled into a kernel: ``MEGANEURA_SHADER_CHECKS`` when set,
    else "unchecked" for a kernel that guards every access itself (``guarded``), else
    "no-loop-bounding"."""
    import os
    mode = os.environ.get("MEGANEURA_SHADER_CHECKS") or ("unchecked" if guarded else "no-loop-bounding")
    if mode not in SHADER_CHECKS:
        raise DeviceError(f"MEGANEURA_SHADER_CHECKS={mode!r} is not one of {', '.join(SHADER_CHECKS)}")
    return mode


def shader_module(device, label: str, code: str, checks: str | None = None):
    """A WGSL shader module; ``checks`` (default ``shader_checks()``) says which of
    naga's runtime checks it keeps. Creating a module with fewer checks goes through
    wgpu-native's ``wgpuDeviceCreateShaderModuleTrusted``, which wgpu-py does not wrap."""
    flags = SHADER_CHECKS[checks or shader_checks()]
    if flags is None:
        return device.create_shader_module(label=label, code=code)
    from wgpu.backends.wgpu_native import _api
    source = _api.new_struct_p("WGPUShaderSourceWGSL *", code=_api.to_c_string_view(code))
    source[0].chain.next = _api.ffi.NULL
    source[0].chain.sType = _api.lib.WGPUSType_ShaderSourceWGSL
    descriptor = _api.new_struct_p(
        "WGPUShaderModuleDescriptor *",
        nextInChain=_api.ffi.cast("WGPUChainedStruct *", source),
        label=_api.to_c_string_view(label))
    handle = _api.libf.wgpuDeviceCreateShaderModuleTrusted(device._internal, descriptor, flags)
    if handle == _api.ffi.NULL:
        raise RuntimeError("shader module creation failed")
    return _api.GPUShaderModule(label, handle, device)


def device_features() -> list[str]:
    """Features enabled on the device of ``get_device()``."""
    return sorted(str(f) for f in get_device().features)


def _version(dist: str):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    """Versions of Python and the packages the engine and Studio run on.

    Packages that are not installed map to None. Nothing is imported except
    wgpu's native backend (already loaded whenever an adapter was requested).
    """
    native = None
    try:
        from wgpu.backends import wgpu_native

        info = getattr(wgpu_native, "lib_version_info", None)
        if info:
            native = ".".join(str(p) for p in info)
    except Exception:
        pass
    out = {"python": platform.python_version()}
    for dist in (
        "meganeura-studio", "numpy", "wgpu", "wgpu-native", "egglog", "PySide6",
        "pyqtgraph", "perfetto", "safetensors", "torch",
    ):
        out[dist] = native if dist == "wgpu-native" else _version(dist)
    return out
