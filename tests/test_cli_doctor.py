import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args, check=True):
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def doctor_json():
    return json.loads(_run("-m", "engine", "doctor", "--json").stdout)


def test_doctor_json(doctor_json):
    adapter = doctor_json["adapter"]
    assert adapter["name"]
    assert isinstance(adapter["software"], bool)
    assert doctor_json["limits"]["max_storage_buffer_binding_size"] > 0
    assert doctor_json["limits"]["max_buffer_size"] > 0
    assert isinstance(doctor_json["features"], list)
    versions = doctor_json["versions"]
    assert versions["numpy"] and versions["wgpu"] and versions["python"]


def test_doctor_sees_vulkan(doctor_json):
    # With mesa-vulkan-drivers, wgpu picks Vulkan (lavapipe without a GPU);
    # without them it falls back to an OpenGL llvmpipe adapter with fewer limits.
    adapter = doctor_json["adapter"]
    assert adapter["backend"] == "Vulkan", "install mesa-vulkan-drivers (scripts/setup.sh)"
    # CI and developer machines have no GPU; set MEGANEURA_EXPECT_GPU=1 where there is one.
    expect_gpu = os.environ.get("MEGANEURA_EXPECT_GPU") == "1"
    assert adapter["software"] is not expect_gpu


def test_doctor_text_mentions_adapter(doctor_json):
    out = _run("-m", "engine", "doctor").stdout
    assert doctor_json["adapter"]["name"] in out
    assert "timestamp-query" in out and "max_storage_buffer_binding_size" in out
    assert "Kernel paths" in out and f"{'reductions':<20}{doctor_json['paths']['reductions']}" in out


def test_doctor_paths_follow_the_device_features(doctor_json):
    from engine import codegen
    paths = doctor_json["paths"]
    assert set(codegen.describe_paths(codegen.PLAIN)) <= set(paths)
    subgroups = {"subgroup", "subgroups"} & set(doctor_json["features"])   # wgpu-native's name, Dawn's
    assert paths["reductions"] == ("subgroup" if subgroups else "workgroup memory")
    from engine.runtime.device import device_capabilities
    caps = device_capabilities()   # the doctor's process has this one's environment
    assert paths["matmul"] == codegen.describe_paths(caps)["matmul"]
    assert paths["matmul"].startswith("cooperative matrices" if caps.matmul_f16 or caps.matmul_split
                                      else "register-blocked f32")
    from engine.cli.doctor import _has_feature
    offered = _has_feature("cooperative-matrix", doctor_json["all_features"])   # Dawn: chromium-experimental-subgroup-matrix
    assert ("cooperative_matrix" in paths) == offered


def test_cli_usage_errors_exit_nonzero():
    assert _run("-m", "engine", check=False).returncode == 2
    assert _run("-m", "engine", "no-such-command", check=False).returncode == 2


def test_meganeura_error_exits_2(monkeypatch, capsys):
    from engine import cli
    from engine.errors import DeviceError

    def broken(args):
        raise DeviceError("no GPU adapter found")

    monkeypatch.setitem(cli.COMMANDS, "broken", cli.Command("test", lambda p: None, broken))
    assert cli.main(["broken"]) == 2
    assert capsys.readouterr().err.strip() == "meganeura: error: no GPU adapter found"


def test_engine_does_not_import_qt():
    code = (
        "import sys, engine.cli, engine.weights, engine.runtime.device; "
        "engine.cli.doctor_report(); "
        "assert 'PySide6' not in sys.modules, 'engine imported Qt'"
    )
    _run("-c", code)


def test_no_adapter_is_a_device_error(monkeypatch, configure):
    import wgpu

    from engine.runtime import device
    from engine.errors import DeviceError

    configure(wgpu="native")   # the Dawn one's help is the next test's
    monkeypatch.setattr(device, "_adapter", None)
    monkeypatch.setattr(device, "_device", None)
    device.native_api()   # loading the backend replaces wgpu.gpu: patch the one it installs
    monkeypatch.setattr(wgpu.gpu, "request_adapter_sync", lambda **kw: None)
    with pytest.raises(DeviceError, match="mesa-vulkan-drivers"):
        device.adapter_info()


def test_no_adapter_through_dawn_says_how_to_run_without_it(monkeypatch, configure):
    import wgpudawn

    from engine.runtime import device
    from engine.errors import DeviceError

    configure(wgpu="dawn")
    device._wgpu()   # loading Dawn's backend replaces wgpudawn.gpu: patch the one it installs
    asked = []
    monkeypatch.setattr(wgpudawn.gpu, "request_adapter_sync", lambda **kw: asked.append(kw))
    with pytest.raises(DeviceError, match="through Dawn .*unset MEGANEURA_WGPU"):
        device.request_adapter()
    assert asked, "the patched request was not the one asked (on lavapipe Dawn finds no adapter anyway)"


def test_device_is_cached_and_has_features():
    from engine.runtime import device

    dev = device.get_device()
    assert device.get_device() is dev
    offered = set(device.adapter_info()["all_features"])
    for feature in ("timestamp-query", "shader-f16"):
        if feature in offered:
            assert feature in device.device_features()
    wanted = device.adapter_info()["limits"]["max_storage_buffer_binding_size"]
    assert dev.limits["max-storage-buffer-binding-size"] == wanted
