"""The GPU adapter and device, and the versions of what we run on.

Two implementations of one API (wgpu-py's) can run the engine: wgpu-py on wgpu-native
(naga compiles the WGSL; the default, and the only one that runs on Debian 12's
lavapipe) and wgpudawn on Google's Dawn (Tint compiles it; it alone lets a kernel use
the GPU's cooperative matrices, wgpu-native 29 refusing every experimental feature).
``MEGANEURA_WGPU=native|dawn`` picks one per process (``backend()``); ``wgpu_module()``
is the module of the one picked, and the few calls outside wgpu-py's API (shader
modules without runtime checks, recording dispatches through the C functions,
timestamps inside passes) ask ``backend()`` which native layer they talk to.

One device per process: ``get_device()`` creates it on first use and returns the
same object afterwards. ``adapter_info()`` describes the adapter wgpu chose
(``meganeura doctor`` prints it). No Qt here.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import importlib
import platform
import re
import threading
from importlib import metadata

from ..codegen.common import SUBGROUP_MATRIX_FEATURE, Capabilities
from ..config import Config, current
from ..errors import DeviceError
from .tuning import adapter_tuning

# Features the engine can use when the adapter offers them, by each backend's names
# (kebab-case). Subgroups and cooperative matrices have had several names across
# wgpu-native releases, hence the loose matching in _interesting_features().
WANTED_FEATURES = {
    "native": ("timestamp-query", "timestamp-query-inside-passes", "shader-f16", "subgroup"),
    "dawn": ("timestamp-query", "chromium-experimental-timestamp-query-inside-passes", "shader-f16",
             "subgroups", SUBGROUP_MATRIX_FEATURE),
}
INSIDE_PASSES = ("timestamp-query-inside-passes", "chromium-experimental-timestamp-query-inside-passes")
_INTERESTING_EXACT = ("timestamp-query", "shader-f16", *INSIDE_PASSES)
_INTERESTING_PREFIXES = ("subgroup", "cooperative-matri", "cooperative_matri", "coop-matri",
                         SUBGROUP_MATRIX_FEATURE)

# Dawn's toggles: its experimental features (subgroup matrices, timestamps inside
# passes) need allow_unsafe_apis, and it keeps f16 off on NVIDIA's Vulkan driver unless asked.
DAWN_INSTANCE_TOGGLES = ("allow_unsafe_apis", "vulkan_enable_f16_on_nvidia")

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

NO_ADAPTER_HELP_DAWN = (
    "no GPU adapter found through Dawn (MEGANEURA_WGPU=dawn): it needs a Vulkan driver of a "
    "real GPU or a recent one (Debian 12's lavapipe lacks features Dawn requires); "
    "unset MEGANEURA_WGPU to run on wgpu-native, which takes lavapipe"
)

_lock = threading.Lock()
_adapter = None
_device = None


def backend() -> str:
    """The wgpu implementation this process runs on: ``MEGANEURA_WGPU`` ("native", the
    default: wgpu-py on wgpu-native; or "dawn": wgpudawn), from the process's configuration."""
    return current().wgpu


def wgpu_module():
    """The wgpu-py API module of ``backend()``: ``wgpu`` or ``wgpudawn`` (same API)."""
    name = backend()
    try:
        if name == "dawn":
            import wgpudawn as module
        else:
            import wgpu as module
    except Exception as exc:  # ImportError, or the native library failing to load
        package = "wgpudawn" if name == "dawn" else "wgpu"
        raise DeviceError(
            f"cannot load {package} ({exc}); install the project with: pip install -e . "
            "(or run scripts/setup.sh)"
        ) from exc
    return module


def _native(part: str):
    """A module of the native layer under ``wgpu_module()``."""
    wgpu_module()
    package = "wgpudawn.backends.dawn" if backend() == "dawn" else "wgpu.backends.wgpu_native"
    return importlib.import_module(f"{package}.{part}")


def native_api():
    """The cffi layer under ``wgpu_module()`` (``ffi``, ``lib``, the GPU object classes):
    the C functions we call where wgpu-py's wrappers cost too much or do not reach."""
    return _native("_api")


def native_extras():
    """The backend's extras module (``write_timestamp``, ``set_instance_extras``, ...)."""
    return _native("extras")


_dawn_toggled = False


def _wgpu():
    """``wgpu_module()``, with Dawn's instance given our toggles before its first use, and
    on wgpu-native the C types the last processes used parsed at once (``ffi_types``)."""
    global _dawn_toggled
    wgpu = wgpu_module()
    if backend() == "dawn" and not _dawn_toggled:
        try:
            native_extras().set_instance_extras(enable_toggles=list(DAWN_INSTANCE_TOGGLES))
        except RuntimeError:   # the instance exists already (another library made it)
            pass
        _dawn_toggled = True
    elif backend() == "native":
        from .ffi_types import prewarm
        prewarm(native_api().ffi)
    return wgpu


def request_adapter():
    """A new adapter of the backend (a discrete GPU when there is one): on Dawn each
    adapter makes one device, so a device of one's own needs an adapter of its own."""
    wgpu = _wgpu()
    help_text = NO_ADAPTER_HELP_DAWN if backend() == "dawn" else NO_ADAPTER_HELP
    try:
        adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    except Exception as exc:
        raise DeviceError(f"{help_text} [wgpu said: {exc}]") from exc
    if adapter is None:
        raise DeviceError(help_text)
    return adapter


def get_adapter():
    """The adapter wgpu picks (a discrete GPU when there is one), cached."""
    global _adapter
    with _lock:
        if _adapter is None:
            _adapter = request_adapter()
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
        "wgpu": backend(),
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
    offers them (on Dawn also subgroup matrices), and the adapter's maximum buffer and
    workgroup-memory sizes (wgpu's defaults are much smaller: 128 MiB bindings, 256 MiB
    buffers, 16 KiB of workgroup memory). wgpu-native offers no cooperative matrices: it
    refuses every experimental feature and its C API has no switch for them. Dawn
    decides robustness (a clamp on every index of every kernel) per device, not per
    kernel: off for every kernel unless ``MEGANEURA_SHADER_CHECKS`` is "checked" or
    "no-loop-bounding" (with it on, the cooperative matmul at 4096^3 ran 26 TFLOP/s
    instead of 70 on the H100), where wgpu-native keeps naga's bounds checks in the
    kernels that do not guard their own accesses (pointwise, reductions). Dawn
    quantizes timestamps to 100 us unless told not to, which would zero every
    dispatch's time: the profiler needs them exact.
    """
    global _device
    adapter = get_adapter()
    with _lock:
        if _device is None:
            offered = {str(f) for f in adapter.features}
            features = [f for f in WANTED_FEATURES[backend()] if f in offered]
            limits = {}
            for name in ("max_storage_buffer_binding_size", "max_buffer_size",
                         "max_compute_workgroup_storage_size", "max_compute_invocations_per_workgroup"):
                value = _limit(adapter.limits, name)
                if value is not None:
                    limits[name.replace("_", "-")] = value
            try:
                if backend() == "dawn":
                    robust = current().shader_checks in ("checked", "no-loop-bounding")
                    _device = native_extras().request_device_sync(
                        adapter, label="meganeura", required_features=features, required_limits=limits,
                        enable_toggles=[] if robust else ["disable_robustness"],
                        disable_toggles=["timestamp_quantization"])
                else:
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
    global _adapter, _device
    with _lock:
        if _device is device:
            _device = None
            if backend() == "dawn":   # Dawn makes one device an adapter; the next one needs a new adapter
                _adapter = None


@contextmanager
def device_guard(what: str, device):
    """Turn wgpu's errors about a lost device ("Parent device is lost") into a
    DeviceError that says what happened and what to do, and forget that device."""
    try:
        yield
    except Exception as exc:
        if not re.search(r"device\]? (is|was) lost", str(exc).lower()):   # wgpu-native's and Dawn's words
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
    return current().shader_checks or ("unchecked" if guarded else "no-loop-bounding")


def shader_module(device, label: str, code: str, checks: str | None = None):
    """A WGSL shader module; ``checks`` (default ``shader_checks()``) says which of
    naga's runtime checks it keeps. Creating a module with fewer checks goes through
    wgpu-native's ``wgpuDeviceCreateShaderModuleTrusted``, which wgpu-py does not wrap.
    Dawn sets its checks for the whole device (``get_device``)."""
    flags = SHADER_CHECKS[checks or shader_checks()]
    if flags is None or backend() == "dawn":
        return device.create_shader_module(label=label, code=code)
    _api = native_api()
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


def has_coop_fragments(adapter) -> bool:
    """Whether the adapter's subgroup matrices include the ones the cooperative kernels
    are written for: f16 x f16 -> f32 fragments of 16 x 16 x 16 on subgroups of exactly
    32 lanes (Dawn's adapter properties; the H100 lists them)."""
    if backend() != "dawn" or SUBGROUP_MATRIX_FEATURE not in {str(f) for f in adapter.features}:
        return False
    if id(adapter) not in _FRAGMENTS:
        try:
            _FRAGMENTS[id(adapter)] = native_extras().get_adapter_properties(adapter).get(
                "subgroup_matrix_configs") or []
        except Exception:
            _FRAGMENTS[id(adapter)] = []
    return any(c["component_type"] == "f16" and c["result_component_type"] == "f32"
               and c["m"] == c["n"] == c["k"] == 16 and c["min_subgroup_size"] == c["max_subgroup_size"] == 32
               for c in _FRAGMENTS[id(adapter)])


_FRAGMENTS: dict[int, list] = {}   # id(adapter) -> its subgroup-matrix configurations


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
        "meganeura-studio", "numpy", "wgpu", "wgpu-native", "wgpudawn", "egglog", "PySide6",
        "pyqtgraph", "perfetto", "safetensors", "scipy", "tokenizers", "soundfile", "torch",
    ):
        out[dist] = native if dist == "wgpu-native" else _version(dist)
    return out


def device_capabilities(device=None, config: Config | None = None) -> Capabilities:
    """The capabilities plans for ``device`` (default: the process's) are compiled with:
    every feature of it that a kernel path uses, its workgroup memory, ``config``'s
    precision and knobs (default: the process's configuration) and the adapter's tuning
    (``meganeura tune``'s cached winners, else the defaults)."""
    config = config or current()
    device = device if device is not None else get_device()
    return Capabilities.from_features(device.features,
                                              _limit(device.limits, "max_compute_workgroup_storage_size"),
                                              dialect="tint" if backend() == "dawn" else "naga",
                                              precision=config.precision, knobs=config.knobs,
                                              fragments=backend() == "dawn" and has_coop_fragments(get_adapter()),
                                              tuning=adapter_tuning(adapter_info()),
                                              invocations=_limit(device.limits, "max_compute_invocations_per_workgroup"),
                                              storage_binding=_limit(device.limits, "max_storage_buffer_binding_size"))


def offered_capabilities(device=None) -> Capabilities:
    """What ``device`` can run: ``device_capabilities`` with f16 asked for, so that
    cooperative matrices are in wherever the device has them, whatever precision the
    process's configuration gives (a session's check of its plan, the tuner's and the
    peaks' f16 kernels), and with them the split f32 products (``matmul_split``), which
    use the same units; kernels choose f16's where both are set."""
    caps = device_capabilities(device, replace(current(), precision="f16"))
    return replace(caps, matmul_split=caps.matmul_f16)


def adapter_summary() -> dict:
    """The adapter as the JSON outputs (train, profile) give it: name, backend, software,
    the wgpu implementation (native or dawn) and the precision matmuls run in on it: f16,
    f32, or f32x3 (f32 operands as three f16 products: ``Capabilities.matmul_split``)."""
    info = adapter_info()
    caps = device_capabilities()
    return {**{k: info[k] for k in ("name", "backend", "software", "wgpu")},
            "matmul_precision": "f16" if caps.matmul_f16 else "f32x3" if caps.matmul_split else "f32"}


def choose_backend(requested: str) -> tuple[str, str | None]:
    """The backend a run takes and, when it is not the one asked for, a one-line note.
    "auto" takes the GPU unless the adapter is a software renderer (lavapipe, llvmpipe),
    where the numpy reference executor is several times faster; "gpu" and "reference"
    are taken as asked."""
    if requested != "auto":
        return requested, None
    info = adapter_info()
    if not info["software"]:
        return "gpu", None
    return "reference", (f"the GPU adapter is a software renderer ({info['name']}): running on the reference "
                         f"executor, which is faster there; --backend gpu forces the adapter")
