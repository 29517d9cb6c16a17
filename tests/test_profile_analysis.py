"""What a profile explains: the roofline bound of each kernel, the adapter's peaks and
their cache, two profiles compared (``meganeura compare``), and a plan's memory timeline.

Numbers are checked against hand computations and invariants, never against times."""

import json
import math

import pytest

from engine.cli import main
from engine.compile.memory import describe_saving, memory_timeline, tenancies
from engine.compile.plan import Binding, Buffer, Dispatch, ExecutionPlan, Transfer, compile_plan
from engine.runtime import peaks as peaks_mod
from engine.runtime.compare import ProfileFileError, compare_profiles, kernel_times, load_profile
from engine.runtime.report import short_kernel
from engine.runtime.roofline import SHORT_NS, classify, compute_peak, kernel_roofline

from test_compile import branchy_graph, mlp_training_graph, training_plan

PEAKS = {"flop_per_s_f32": 10e12, "flop_per_s_f16": 100e12, "bytes_per_s": 1e12}


# ---------------------------------------------------------------- roofline

def row(flops, nbytes, gpu_ns, calls=1, archetype="matmul", name="k"):
    return {"name": name, "archetype": archetype, "calls": calls, "flops": flops, "bytes": nbytes, "gpu_ns": gpu_ns}


def test_each_bound_and_its_percent():
    # 4096^3 matmul: 137 GFLOP at 10 TFLOP/s is 13.7 ms; 200 MB at 1 TB/s only 0.2 ms
    flops = 2 * 4096 ** 3
    r = kernel_roofline(row(3 * flops, 3 * 200e6, 3 * 27.5e6, calls=3), PEAKS)
    assert r["bound"] == "compute"
    assert r["percent_of_peak"] == pytest.approx(100 * flops / 10e12 / 27.5e-3)
    assert r["intensity"] == pytest.approx(flops / 200e6)
    # a 1 GB copy at 0.8 TB/s: memory, 80% of the bandwidth
    r = kernel_roofline(row(0, 1e9, 1.25e6, archetype="copy"), PEAKS)
    assert (r["bound"], r["percent_of_peak"]) == ("memory", pytest.approx(80.0))
    # shorter than SHORT_NS: latency, whatever its intensity
    assert classify(1e9, 1e3, SHORT_NS - 1, 10e12, 1e12)[0] == "latency"
    # 1 MB moved (1 us at the roof) in 40 us: too small to fill the device
    bound, pct = classify(0, 1e6, 40e3, 10e12, 1e12)
    assert bound == "latency" and pct == pytest.approx(2.5)
    # the same 1 MB in 3 us runs near its roof: memory
    assert classify(0, 1e6, 3e3, 10e12, 1e12) == ("memory", pytest.approx(100 / 3))
    # a big kernel far from its roof is not latency-bound: it is slow at its bound
    assert classify(0, 1e9, 100e6, 10e12, 1e12) == ("memory", pytest.approx(1.0))


def test_roofline_without_peaks_and_the_f16_roof():
    assert kernel_roofline(row(1e9, 1e6, 1e6), None) == {"bound": None, "percent_of_peak": None,
                                                           "intensity": 1e3}
    assert compute_peak(PEAKS, "matmul", "f16") == 100e12
    assert compute_peak(PEAKS, "attention", "f16") == 100e12   # cooperative forward and backward
    assert compute_peak(PEAKS, "reduction", "f16") == 10e12
    assert compute_peak(PEAKS, "matmul", "f32") == 10e12
    assert compute_peak({**PEAKS, "flop_per_s_f16": None}, "matmul", "f16") == 10e12
    # f32 as three f16 products: a third of the f16 roof for products, attention in f32
    assert compute_peak(PEAKS, "conv", "f32x3") == pytest.approx(100e12 / 3)
    assert compute_peak(PEAKS, "attention", "f32x3") == compute_peak(PEAKS, "reduction", "f32x3") == 10e12


# ---------------------------------------------------------------- peaks and their cache

def test_peaks_cache_is_written_read_and_keyed(tmp_path, monkeypatch):
    info = {"name": "Some GPU", "description": "driver 1.2", "backend": "Vulkan", "wgpu": "native"}
    key = peaks_mod.peaks_key(info)
    assert key["adapter"] == "Some GPU" and key["driver"] == "driver 1.2" and key["backend"] == "Vulkan"
    assert key["engine"] and key["wgpu"] == "native"
    assert peaks_mod.read_peaks(key, tmp_path) is None
    measured = {**PEAKS, "timing": "gpu timestamps"}
    path = peaks_mod.write_peaks(key, measured, tmp_path)
    assert path.parent == tmp_path and path.name.startswith("Some-GPU-")
    assert peaks_mod.read_peaks(key, tmp_path) == measured
    for changed in ({"description": "driver 1.3"}, {"backend": "Metal"}, {"wgpu": "dawn"}, {"name": "Other"}):
        other = peaks_mod.peaks_key({**info, **changed})
        assert peaks_mod.key_file_name(other) != path.name and peaks_mod.read_peaks(other, tmp_path) is None
    path.write_text("{not json")
    assert peaks_mod.read_peaks(key, tmp_path) is None
    path.write_text(json.dumps({"key": key, "peaks": {**PEAKS, "bytes_per_s": -1}}))
    assert peaks_mod.read_peaks(key, tmp_path) is None

    # adapter_peaks measures once, then reads the cache (the process's adapter's key)
    calls = []
    monkeypatch.setattr(peaks_mod, "measure_peaks", lambda device=None: calls.append(1) or dict(measured))
    first = peaks_mod.adapter_peaks(cache_dir=tmp_path)
    second = peaks_mod.adapter_peaks(cache_dir=tmp_path)
    assert len(calls) == 1 and first["cached"] is False and second["cached"] is True
    assert second["flop_per_s_f32"] == PEAKS["flop_per_s_f32"]
    peaks_mod.adapter_peaks(cache_dir=tmp_path, refresh=True)
    assert len(calls) == 2


@pytest.mark.parametrize("timestamps", [True, False])
def test_a_real_measurement_on_this_adapter(monkeypatch, timestamps):
    if not timestamps:   # an adapter without timestamp-query: CPU wall time per submission
        monkeypatch.setattr(peaks_mod, "timestamp_support", lambda device: None)
    p = peaks_mod.measure_peaks()
    for k in ("flop_per_s_f32", "bytes_per_s"):
        assert math.isfinite(p[k]) and p[k] > 0, p
    assert p["flop_per_s_f16"] is None or p["flop_per_s_f16"] > 0   # lavapipe: no cooperative matrices
    assert p["timing"] == ("gpu timestamps" if timestamps else "cpu wall time per submission")
    software = peaks_mod.adapter_info()["software"]
    assert p["sizes"] == (peaks_mod.SOFTWARE_SIZES if software else peaks_mod.HARDWARE_SIZES)   # tiny work on lavapipe


# ---------------------------------------------------------------- compare

def profile(steps, kernels, model="m"):
    """A minimal profile --json object: (name, total gpu_ns, calls) per per_kernel row."""
    return {"model": model, "steps": steps, "adapter": {"name": "gpu", "matmul_precision": "f32"},
            "per_kernel": [{"name": n, "gpu_ns": ns, "calls": c} for n, ns, c in kernels]}


def test_compare_two_synthetic_profiles():
    a = profile(2, [("mm", 800, 2), ("soft", 200, 2), ("mm", 200, 2), ("old", 100, 2)])
    b = profile(4, [("mm", 1200, 4), ("soft", 800, 4), ("new", 40, 4)], model="m2")
    assert kernel_times(a)["mm"] == {"ns": 500.0, "calls": 2.0}     # two rows of one name, per step
    c = compare_profiles(a, b, "a.json", "b.json")
    rows = {r["name"]: r for r in c["rows"]}
    assert set(rows) == {"mm", "soft"}
    assert rows["mm"] == {"name": "mm", "a_ns": 500.0, "b_ns": 300.0, "delta_ns": -200.0, "ratio": 0.6,
                          "a_calls": 2.0, "b_calls": 1.0}
    assert rows["soft"]["a_ns"] == 100.0 and rows["soft"]["b_ns"] == 200.0 and rows["soft"]["ratio"] == 2.0
    assert [r["name"] for r in c["rows"]] == ["mm", "soft"]              # biggest change first
    assert c["only_a"] == [{"name": "old", "a_ns": 50.0}] and c["only_b"] == [{"name": "new", "b_ns": 10.0}]
    assert c["a_total_ns"] == 650.0 and c["b_total_ns"] == 510.0 and c["delta_total_ns"] == -140.0
    assert c["ratio_total"] == pytest.approx(510 / 650)
    assert c["matched_a_ns"] == 600.0 and c["matched_b_ns"] == 500.0
    assert c["a"]["source"] == "a.json" and any("models" in n for n in c["notes"])
    with pytest.raises(ProfileFileError):
        compare_profiles({"steps": 1}, b)


@pytest.fixture(scope="module")
def two_mlp_profiles(tmp_path_factory):
    """Two real profile --json outputs of mlp (2 and 3 steps), through the CLI."""
    import contextlib
    import io
    folder = tmp_path_factory.mktemp("profiles")
    paths = []
    for steps in (2, 3):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["profile", "mlp", "--steps", str(steps), "--set", "batch=8", "--json"]) == 0
        paths.append(folder / f"mlp-{steps}.json")
        paths[-1].write_text(out.getvalue())
    return paths


def test_compare_two_real_profiles_on_the_command_line(two_mlp_profiles, capsys):
    a_path, b_path = two_mlp_profiles
    a, b = load_profile(a_path), load_profile(b_path)
    assert main(["compare", str(a_path), str(b_path), "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    names = {k["name"] for k in a["per_kernel"]}
    assert {r["name"] for r in c["rows"]} == names and not c["only_a"] and not c["only_b"]
    for r in c["rows"]:
        ka = next(k for k in a["per_kernel"] if k["name"] == r["name"])
        kb = next(k for k in b["per_kernel"] if k["name"] == r["name"])
        assert r["a_ns"] == pytest.approx(ka["gpu_ns"] / 2) and r["b_ns"] == pytest.approx(kb["gpu_ns"] / 3)
        assert r["ratio"] == pytest.approx(r["b_ns"] / r["a_ns"]) and r["a_calls"] == r["b_calls"] == ka["calls"] / 2
    assert c["a_total_ns"] == pytest.approx(sum(k["gpu_ns"] for k in a["per_kernel"]) / 2)
    assert main(["compare", str(a_path), str(b_path)]) == 0
    text = capsys.readouterr().out
    assert "B/A" in text and "Total (all kernels)" in text
    assert all(short_kernel(k["name"])[:20] in text for k in a["per_kernel"])   # the table shows names shortened


def test_profile_json_has_the_roofline_and_memory(two_mlp_profiles):
    p = load_profile(two_mlp_profiles[0])
    assert p["peaks"]["flop_per_s_f32"] > 0 and p["peaks"]["bytes_per_s"] > 0
    for k in p["per_kernel"]:
        assert k["bound"] in ("compute", "memory", "latency") and k["percent_of_peak"] >= 0
    m = p["memory"]
    assert len(m["live_bytes"]) == p["dispatches_per_step"] and m["peak_bytes"] == max(m["live_bytes"])
    assert m["live_bytes"][m["peak_dispatch"]] == m["peak_bytes"] == sum(b["bytes"] for b in m["peak_buffers"])
    assert m["peak_bytes"] <= m["plan_bytes"] <= m["unshared_bytes"] and m["plan_bytes"] <= m["allocated_bytes"]


@pytest.mark.parametrize("content", ["not json at all", json.dumps({"model": "x"}), json.dumps([1, 2])])
def test_compare_refuses_a_bad_file_in_one_line(two_mlp_profiles, tmp_path, capsys, content):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main(["compare", str(two_mlp_profiles[0]), str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.json" in err and "profile --json" in err
    assert main(["compare", str(tmp_path / "missing.json"), str(two_mlp_profiles[0])]) == 2
    assert "no such file" in capsys.readouterr().err


# ---------------------------------------------------------------- memory timeline

def hand_plan():
    """Buffers: input 1024, parameter 512, pooled 2048 and 1024, output 256. Dispatch 0
    writes A (2048) into buffer 2; 1 reads A, writes B (1024) into 3; 2 reads B and
    writes C (1536) into 2 again (reuse); 3 reads C, writes the output; a transfer after
    dispatch 3 reads buffer 3 (B), which keeps B alive to 3."""
    bufs = [Buffer(0, 1024, "input", ["x"]), Buffer(1, 512, "parameter", ["w"]), Buffer(2, 2048, "intermediate"),
            Buffer(3, 1024, "intermediate"), Buffer(4, 256, "output", ["y"])]
    r, w = "read", "read_write"

    def dispatch(i, *bindings):
        return Dispatch(i, f"k{i}", "pointwise", [], 1, bindings=[Binding(b, 0, s, a) for b, s, a in bindings])
    ds = [dispatch(0, (0, 1024, r), (1, 512, r), (2, 2048, w)), dispatch(1, (2, 2048, r), (3, 1024, w)),
          dispatch(2, (3, 1024, r), (2, 1536, w)), dispatch(3, (2, 1536, r), (4, 256, w))]
    return ExecutionPlan("h", "0", bufs, ds, {}, {"x": 0}, {"w": 1}, {"y": 4}, {}, None, 4864, 6400,
                         transfers=[Transfer(3, 3, 0, 4, 0, 4)])


def test_memory_timeline_of_a_hand_computed_plan():
    plan = hand_plan()
    held = tenancies(plan)
    assert [(t.buffer, t.first, t.last, t.nbytes) for t in held] == [(2, 0, 1, 2048), (3, 1, 3, 1024),
                                                                     (2, 2, 3, 1536)]
    m = memory_timeline(plan)
    pinned = 1024 + 512 + 256
    assert m.pinned_bytes == pinned
    assert m.live_bytes == [pinned + 2048, pinned + 2048 + 1024, pinned + 1024 + 1536, pinned + 1024 + 1536]
    assert (m.peak_bytes, m.peak_dispatch) == (pinned + 3072, 1)
    assert [(b["buffer"], b["bytes"]) for b in m.peak_buffers] == [(2, 2048), (0, 1024), (3, 1024), (1, 512),
                                                                   (4, 256)]
    assert m.allocated_bytes == 4864 and m.unshared_bytes == pinned + 2048 + 1024 + 1536
    assert m.saved_bytes == 1536 and m.to_dict()["saved_bytes"] == 1536
    assert "saves 1.5 KiB (24%)" in describe_saving(m.unshared_bytes, m.allocated_bytes, m.peak_bytes)
    # only some dispatches recorded, in this order
    part = memory_timeline(plan, order=[2, 0])
    assert part.live_bytes == [pinned + 2560, pinned + 2048] and part.peak_dispatch == 0


@pytest.mark.parametrize("kind", ["forward", "training"])
def test_memory_timeline_invariants_on_compiled_plans(kind):
    if kind == "forward":
        graph = branchy_graph()
        plan = compile_plan(graph)
    else:
        from engine.train.config import TrainConfig
        graph, _, plan = training_plan(mlp_training_graph(), TrainConfig(optimizer="adam"))
    m = memory_timeline(plan, graph)
    assert len(m.live_bytes) == len(plan.dispatches)
    assert all(v >= m.pinned_bytes > 0 for v in m.live_bytes)
    assert m.peak_bytes == max(m.live_bytes) == m.live_bytes[m.peak_dispatch]
    assert m.peak_bytes == sum(b["bytes"] for b in m.peak_buffers)
    assert m.peak_bytes <= m.allocated_bytes == plan.peak_bytes <= m.unshared_bytes
    if kind == "forward":   # the plan's own count of tensors without reuse (it has no scratch buffers)
        assert m.unshared_bytes == plan.peak_bytes_without_reuse and m.saved_bytes > 0
    # every value held in a pooled buffer is a graph node's (or its partials)
    names = {n.name or f"%{n.id}" for n in graph.nodes}
    held = tenancies(plan, graph)
    assert all(t.name.split(" (")[0].split(", ")[0] in names for t in held)
    assert all(t.name.endswith(")") and (" (output of " in t.name or " (partials of " in t.name) for t in held)
