"""The caches that make a second build of a session quick: the optimized graphs (forward,
and autodiff + training optimize) and the compiled plan on disk, and wgpu-native's C type
names parsed at once. A warm build must give exactly what a cold one gives."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import cffi
import numpy as np
import pytest

import engine.optimize
from engine import models
from engine.compile import cache
from engine.compile.cache import cached_optimize, cached_plan, cached_training_graph
from engine.compile.plan import compile_plan
from engine.graph import reference
from engine.runtime import ffi_types
from engine.train.config import TrainConfig
from engine.train.session import build_session

ROOT = Path(__file__).resolve().parent.parent


def mlp(batch=4):
    model = models.create("mlp", [f"batch={batch}"])
    return model, model.build(train=True)


@pytest.fixture
def optimize_calls(monkeypatch):
    """How many times the egglog optimizer ran (a cache hit runs none)."""
    calls = []
    real = engine.optimize.optimize

    def counted(graph, **options):
        calls.append(graph.name)
        return real(graph, **options)
    monkeypatch.setattr(engine.optimize, "optimize", counted)
    return calls


@pytest.mark.parametrize("name, settings, train", [("mlp", ["batch=4"], True),
                                                    ("gpt-tiny", ["batch=1", "seq=8"], False)])
def test_a_cached_graph_gives_the_plan_a_fresh_one_gives(tmp_path, optimize_calls, name, settings, train):
    graph = models.create(name, settings).build(train=train)
    if train:
        cold = cached_training_graph(graph, "loss", tmp_path)
        warm = cached_training_graph(graph, "loss", tmp_path)
        (out, pairs), (again, again_pairs) = cold[:2], warm[:2]
        assert again_pairs == pairs and all(isinstance(p, tuple) for p in again_pairs)
        reports = zip(cold[2:], warm[2:])
    else:
        out, report = cached_optimize(graph, tmp_path)
        again, again_report = cached_optimize(graph, tmp_path)
        pairs, reports = [], [(report, again_report)]
    assert len(optimize_calls) == (2 if train else 1)   # the second call read the cache
    assert again.to_dict() == out.to_dict()             # names, modules, attributes, constants
    for fresh, read in reports:
        assert read.to_dict() == fresh.to_dict()
    loss = "loss" if train else None
    assert compile_plan(again, dict(pairs), loss) == compile_plan(out, dict(pairs), loss)


def test_a_warm_session_computes_what_the_cold_one_did(tmp_path, configure):
    configure(cache_dir=str(tmp_path))
    model, graph = mlp()
    params = model.init_params(0)
    batch = model.example_inputs(train=True, seed=0)
    config = TrainConfig(optimizer="sgd", lr=0.1)
    results = []
    for _ in range(2):
        session = build_session(graph, config, params)
        assert [name for name, _, _ in session.build_spans][:2] == ["optimize, differentiate, optimize",
                                                                    "compile plan"]
        assert session.build_seconds > 0
        session.set_inputs({k: v for k, v in batch.items() if k in session.graph.inputs})
        loss, _ = session.step()
        results.append((session.plan, loss, session.get_parameters()))
    assert len(list((tmp_path / "graphs").iterdir())) == len(list((tmp_path / "plans").iterdir())) == 1
    (plan, loss, after), (warm_plan, warm_loss, warm_after) = results
    assert warm_plan == plan
    want = float(reference.run(graph, batch, params, np.float64)["loss"])
    assert loss == pytest.approx(want, rel=1e-4) and warm_loss == pytest.approx(loss, rel=1e-6)
    for name in after:
        np.testing.assert_allclose(warm_after[name], after[name], rtol=1e-6, atol=1e-7)


def test_the_graph_cache_misses_when_its_input_or_the_code_changes(tmp_path, optimize_calls, monkeypatch):
    _, graph = mlp()
    cached_optimize(graph, tmp_path)
    cached_optimize(graph, tmp_path)
    assert len(optimize_calls) == 1
    _, bigger = mlp(batch=8)
    frozen = graph.copy()
    frozen.param_meta["fc1.weight"]["trainable"] = False
    renamed = graph.copy()
    renamed.set_modules(renamed.parameters["fc2.bias"], "head")
    for changed in (bigger, frozen, renamed):
        cached_optimize(changed, tmp_path)
    assert len(optimize_calls) == 4
    monkeypatch.setattr(cache, "_rules_fingerprint", lambda: "edited rules")
    cached_optimize(graph, tmp_path)
    monkeypatch.setattr(cache, "__version__", "99.0")
    cached_optimize(graph, tmp_path)
    assert len(optimize_calls) == 6
    cached_training_graph(graph, "loss", tmp_path)
    other_loss = graph.copy()
    other_loss.output("objective", other_loss.outputs["loss"])
    cached_training_graph(other_loss, "objective", tmp_path)
    assert len(optimize_calls) == 10
    assert len(list(tmp_path.glob("*.json"))) == 8


def test_a_second_generation_reads_its_graphs_from_the_cache(tmp_path, configure, optimize_calls):
    """A second process's generator (here a second generator) takes the decode step's and
    the prefill's optimized graphs from the cache, builds the same plans and generates the
    same ids; a prompt of another length runs in the same padded prefill, and a longer one
    optimizes its own."""
    configure(cache_dir=str(tmp_path))
    model = models.create("gpt-tiny", [])
    prompt = [5, 9, 200, 31, 7]
    runs = []
    for _ in range(2):
        generator = model.generator(backend="gpu")
        result = generator.generate(prompt, 5)
        steps = generator.steps(result.capacity)
        runs.append((result.tokens, steps.decode.plan, steps.session(len(prompt), prefill=True).plan))
        assert result.build_seconds > 0
    assert len(optimize_calls) == 2 and runs[1] == runs[0]
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "graphs").iterdir()) == ["generation"] * 2
    model.generator(backend="gpu").generate(prompt + [3], 2)
    assert len(optimize_calls) == 2
    model.generator(backend="gpu").generate(prompt * 14, 2)   # 70 tokens: a prefill of 128
    assert len(optimize_calls) == 3


def test_a_corrupt_or_stale_entry_is_rebuilt_with_a_warning(tmp_path):
    _, graph = mlp()
    out, _ = cached_optimize(graph, tmp_path)
    (path,) = tmp_path.iterdir()
    path.write_text('{"input_hash": ')
    with pytest.warns(UserWarning, match="optimized graph cache .* is unreadable"):
        again, _ = cached_optimize(graph, tmp_path)
    assert again.to_dict() == out.to_dict()
    entry = json.loads(path.read_text())   # rewritten
    entry["graph"]["nodes"][-1]["op"] = "no_such_op"
    path.write_text(json.dumps(entry))
    with pytest.warns(UserWarning, match="unreadable"):
        cached_optimize(graph, tmp_path)
    entry = json.loads(path.read_text())
    entry["input_hash"] = "0" * 64
    path.write_text(json.dumps(entry))
    with pytest.warns(UserWarning, match="is stale"):
        cached_optimize(graph, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cached_optimize(graph, tmp_path)[0].to_dict() == out.to_dict()


def test_an_unwritable_cache_folder_is_a_warning_not_an_error(tmp_path, configure):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    model, graph = mlp()
    with pytest.warns(UserWarning, match="cannot write the optimized graph cache"):
        out, _ = cached_optimize(graph, blocker / "graphs")
    with pytest.warns(UserWarning, match="cannot write the plan cache"):
        assert cached_plan(out, cache_dir=blocker / "plans") == compile_plan(out)
    configure(cache_dir=str(blocker))
    with pytest.warns(UserWarning, match="cannot write"):
        session = build_session(graph, TrainConfig(optimizer="sgd", lr=0.1), model.init_params(0))
    assert session.plan.loss == "loss"
    assert list(tmp_path.iterdir()) == [blocker]


def test_a_warm_build_does_not_load_egglog(tmp_path):
    _, graph = mlp()
    cached_training_graph(graph, "loss", tmp_path)
    script = ("import sys; from pathlib import Path; from engine import models; "
              "from engine.compile.cache import cached_training_graph; "
              "g = models.create('mlp', ['batch=4']).build(train=True); "
              f"out = cached_training_graph(g, 'loss', Path({str(tmp_path)!r})); "
              "assert 'egglog' not in sys.modules, 'egglog was imported'; print(len(out[0].nodes))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == len(cached_training_graph(graph, "loss", tmp_path)[0].nodes)


# ---------------------------------------------------------------- wgpu-native's C types

HEADER = "typedef struct Foo { int a; double b; struct Foo *next; } Foo; typedef unsigned char Byte;"
NAMES = ["Foo *", "Byte[]", "void(Foo *, int)", "Foo const *"]


def test_types_parsed_at_once_are_the_ones_cffi_parses_one_by_one(monkeypatch):
    batch, single = cffi.FFI(), cffi.FFI()
    batch.cdef(HEADER)
    single.cdef(HEADER)
    assert ffi_types.parse_at_once(batch, NAMES)
    monkeypatch.setattr(batch._parser, "parse_type", lambda cdecl: pytest.fail(f"{cdecl} parsed again"))
    for name in ("Foo *", "Byte[]", "Foo const *"):
        assert batch.typeof(name).cname == single.typeof(name).cname
        assert batch.typeof(name).kind == single.typeof(name).kind
    assert batch.new("Foo *", {"a": 3}).a == 3
    assert batch.typeof(batch.callback("void(Foo *, int)", lambda p, n: None)).cname == "void(*)(Foo *, int)"
    assert ffi_types.parsed_names(batch) == sorted(NAMES)
    failing = cffi.FFI()
    failing.cdef(HEADER)
    assert not ffi_types.parse_at_once(failing, ["Foo *", "Nope *"])
    assert ffi_types.parsed_names(failing) == []


def test_the_names_a_wgpu_process_parsed_parse_at_once_in_a_fresh_ffi():
    """wgpu-native's own FFI, whichever backend the suite runs on (Dawn's has no parser cache)."""
    import wgpu
    from wgpu.backends import wgpu_native
    from wgpu.backends.wgpu_native import _ffi
    device = wgpu_native.gpu.request_adapter_sync(power_preference="high-performance").request_device_sync()
    device.create_buffer(size=16, usage=wgpu.BufferUsage.STORAGE)
    names = ffi_types.parsed_names(_ffi.ffi)
    assert "WGPUBufferDescriptor *" in names
    fresh = cffi.FFI()
    fresh.cdef(_ffi.get_wgpu_header())
    assert ffi_types.parse_at_once(fresh, names)
    assert fresh.typeof("WGPUBufferDescriptor *").cname == "WGPUBufferDescriptor *"


def test_type_names_are_remembered_and_a_bad_file_is_ignored(tmp_path):
    ffi = cffi.FFI()
    ffi.cdef(HEADER)
    ffi.typeof("Foo *")
    path = tmp_path / "ffi-types" / "wgpu-test.json"
    ffi_types.remember(ffi, path, set())
    assert ffi_types.load_names(path) == ["Foo *"]
    ffi_types.remember(ffi, path, {"Byte[]"})
    assert ffi_types.load_names(path) == ["Byte[]", "Foo *"]
    path.write_text('{"not": "a list"}')
    with pytest.warns(UserWarning, match="wgpu type names cache .* is unreadable"):
        assert ffi_types.load_names(path) == []
    blocker = tmp_path / "a file"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="cannot write the wgpu type names cache"):
        ffi_types.remember(ffi, blocker / "wgpu-test.json", set())
