"""Per-dispatch GPU profiling on lavapipe (which offers timestamp-query) and the traces.

Timing values are only checked for sanity (positive, consistent with each other);
performance is asserted in benchmarks, never here.
"""

import json

import numpy as np
import pytest

from engine import Graph
from engine.runtime import profiler
from engine.runtime.dispatches import estimate_flops
from engine.runtime.trace import write_chrome_trace, write_perfetto
from engine.cli import main
from engine.errors import MeganeuraError
from engine.runtime.session import build_inference_session

STEPS = 3


def small_mlp():
    g = Graph("tiny-mlp")
    x = g.input("x", (16, 64))
    w1 = g.parameter("fc1.weight", (64, 96))
    b1 = g.parameter("fc1.bias", (96,))
    w2 = g.parameter("fc2.weight", (96, 10))
    h = g.relu(g.bias_add(g.matmul(x, w1), b1))
    g.output("logits", g.matmul(h, w2))
    return g


@pytest.fixture(scope="module")
def session():
    g = small_mlp()
    s = build_inference_session(g)
    rng = np.random.default_rng(0)
    s.set_input("x", rng.standard_normal((16, 64)))
    for name, node in g.parameters.items():
        s.set_parameter(name, rng.standard_normal(g[node].shape) * 0.1)
    return s


@pytest.fixture(scope="module")
def report(session):
    return session.profile(STEPS)


def check_timings(report, session):
    n = len(session.plan.dispatches)
    assert len(report.dispatches) == STEPS * n
    for step in range(STEPS):
        ds = [d for d in report.dispatches if d.step == step]
        assert [d.index for d in ds] == list(range(n))
        assert [d.kernel for d in ds] == [d.kernel for d in session.plan.dispatches]
        assert all(d.gpu_ns > 0 for d in ds), [d.gpu_ns for d in ds]
        span = max(d.end_ns for d in ds) - min(d.begin_ns for d in ds)
        total = sum(d.gpu_ns for d in ds)
        assert report.gpu_step_ns[step] > 0
        if report.mode == profiler.MODE_PER_PASS:
            # a pass each, run in order; between passes the GPU idles, on the H100 longer than these
            # tiny dispatches run (13.6 us of a 20.7 us step): their sum is bounded by the step, not near it
            assert all(a.end_ns <= b.begin_ns for a, b in zip(ds, ds[1:])), [(d.begin_ns, d.end_ns) for d in ds]
            assert total <= span, (total, span)
        else:
            assert abs(total - report.gpu_step_ns[step]) <= 0.2 * report.gpu_step_ns[step], (total, report.gpu_step_ns)
        assert abs(span - report.gpu_step_ns[step]) <= 0.01 * span + 1000


def test_every_dispatch_of_every_step_is_timed(report, session):
    assert report.timestamps is True
    assert report.mode == profiler.timestamp_support(session.device)
    check_timings(report, session)
    # (the graph builder may fuse bias and ReLU into the first matmul's epilogue)
    first, second = report.dispatches[:2]
    assert 2 * 16 * 96 * 64 <= first.flops <= 2 * 16 * 96 * 64 + 3 * 16 * 96
    assert second.flops == 2 * 16 * 10 * 96
    g = session.graph
    node = g[session.plan.dispatches[0].nodes[0]]
    assert first.bytes == sum(g[i].nbytes for i in node.inputs) + node.nbytes >= 4 * (16 * 64 + 64 * 96 + 16 * 96)
    assert first.nodes and first.ops == [node.op] and len(first.workgroups) == 3
    for s in report.step_records:
        assert s.record_ns > 0 and s.submit_ns > 0 and s.wait_ns > 0 and s.wall_ns >= s.record_ns
    assert report.overhead["step_wall_ns_without"] > 0
    assert report.memory["allocated_bytes"] >= report.memory["peak_bytes"]


@pytest.mark.parametrize("mode", [profiler.MODE_PER_PASS, profiler.MODE_INSIDE])
def test_each_timestamp_mode(session, mode):
    # lavapipe (CI) and the H100 both offer timestamp-query-inside-passes: both modes run.
    assert profiler.timestamp_support(session.device) == profiler.MODE_INSIDE
    r = profiler.profile_session(session, STEPS, mode=mode, measure_overhead=False)
    assert r.mode == mode and r.timestamps
    check_timings(r, session)


def test_aggregates_dict_and_table(report, session):
    kernels = report.per_kernel()
    assert sum(k["calls"] for k in kernels) == len(report.dispatches)
    assert sum(k["gpu_ns"] for k in kernels) == sum(d.gpu_ns for d in report.dispatches)
    assert {a["name"] for a in report.per_archetype()} == {d.archetype for d in session.plan.dispatches}
    assert report.achieved()["gb_per_s"] > 0 and report.achieved()["tflop_per_s"] > 0
    d = report.to_dict()
    for key in ("model", "adapter", "steps", "timestamps", "dispatches", "gpu_step_ns", "trace"):
        assert key in d
    assert d["steps"] == STEPS and len(d["gpu_step_ns"]) == STEPS
    for row in d["dispatches"]:
        assert {"step", "index", "kernel", "nodes", "gpu_ns", "bytes", "flops"} <= set(row)
    json.dumps(d)
    table = report.format_table(top=15)
    assert "GPU total" in table and "matmul" in table and "# Calls" in table
    assert "overhead" in table


def read_perfetto(path):
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
    trace = pb.Trace()
    trace.ParseFromString(path.read_bytes())
    tracks, events = {}, []
    for p in trace.packet:
        if p.HasField("track_descriptor"):
            tracks[p.track_descriptor.uuid] = p.track_descriptor
        if p.HasField("track_event"):
            events.append((p.timestamp, p.track_event))
    return pb, tracks, events


def slices(pb, events, track):
    """Complete slices (name, begin, end, depth, begin event) of one track, checking nesting."""
    out, stack = [], []
    for ts, ev in sorted(((ts, ev) for ts, ev in events if ev.track_uuid == track), key=lambda x: x[0]):
        if ev.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            stack.append((ev.name, ts, ev))
        elif ev.type == pb.TrackEvent.TYPE_SLICE_END:
            assert stack, "slice end without a begin"
            name, b, bev = stack.pop()
            out.append((name, b, ts, len(stack), bev))
    assert not stack, "unterminated slices"
    return out


def test_perfetto_trace(report, session, tmp_path):
    path = tmp_path / "p.pftrace"
    write_perfetto(report, path)
    assert report.trace == str(path)
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]
    pb, tracks, events = read_perfetto(path)

    process = [t for t in tracks.values() if t.HasField("process")]
    thread = [t for t in tracks.values() if t.HasField("thread")]
    counters = {t.name: t for t in tracks.values() if t.HasField("counter")}
    assert len(process) == 1 and report.adapter["name"] in process[0].process.process_name
    assert len(thread) == 1
    gpu = [t for t in tracks.values() if t.name.startswith("GPU queue")]
    assert len(gpu) == 1 and report.adapter["name"] in gpu[0].name
    assert {"GPU memory allocated (bytes)", "live tensors (bytes)"} <= set(counters)

    # CPU spans nest: every step's record/submit/wait inside "step k" inside "profile".
    cpu = slices(pb, events, thread[0].uuid)
    by_name = {}
    for name, b, e, depth, _ in cpu:
        by_name.setdefault(name, []).append((b, e, depth))
    (prof,) = by_name["profile"]
    for k in range(STEPS):
        (step,) = by_name[f"step {k}"]
        assert prof[0] <= step[0] <= step[1] <= prof[1] and step[2] == prof[2] + 1
    assert len(by_name["submit"]) == STEPS and all(d == prof[2] + 2 for _, _, d in by_name["submit"])
    assert {"allocate buffers", "create pipelines and bind groups"} <= set(by_name)

    # One GPU slice per dispatch, positive duration, the plan's kernel names.
    gpu_slices = slices(pb, events, gpu[0].uuid)
    assert len(gpu_slices) == STEPS * len(session.plan.dispatches)
    assert all(e > b for _, b, e, _, _ in gpu_slices)
    names = [name for name, *_ in sorted(gpu_slices, key=lambda s: s[1])]
    assert names == [d.kernel for d in session.plan.dispatches] * STEPS
    ann = {a.name for a in gpu_slices[0][4].debug_annotations}
    assert {"nodes", "shapes", "workgroups", "bytes", "flops"} <= ann

    # Flows: each step's submit to each of its GPU slices.
    out_flows = [f for _, _, _, _, ev in cpu for f in ev.flow_ids]
    in_flows = [f for _, _, _, _, ev in gpu_slices for f in ev.terminating_flow_ids]
    assert len(in_flows) == len(gpu_slices) and sorted(out_flows) == sorted(in_flows)

    # Counters and the adapter metadata.
    assert any(ev.type == pb.TrackEvent.TYPE_COUNTER and ev.track_uuid == counters["live tensors (bytes)"].uuid
               for _, ev in events)
    (meta,) = [ev for _, ev in events if ev.type == pb.TrackEvent.TYPE_INSTANT]
    values = {a.name: a for a in meta.debug_annotations}
    assert values["adapter"].string_value == report.adapter["name"]
    assert values["backend"].string_value == report.adapter["backend"]
    assert values["timestamps"].bool_value is True


def test_chrome_trace(report, session, tmp_path):
    path = tmp_path / "p.json"
    write_chrome_trace(report, path)
    data = json.loads(path.read_text())
    ev = data["traceEvents"]
    gpu = [e for e in ev if e["ph"] == "X" and e["cat"] == "gpu"]
    assert len(gpu) == STEPS * len(session.plan.dispatches) and all(e["dur"] > 0 for e in gpu)
    assert len([e for e in ev if e["ph"] == "s"]) == len([e for e in ev if e["ph"] == "f"]) == len(gpu)
    assert any(e["ph"] == "C" for e in ev)
    assert data["otherData"]["adapter"] == report.adapter


def test_fallback_without_timestamp_query(session, monkeypatch, tmp_path):
    monkeypatch.setattr(profiler, "timestamp_support", lambda device: None)
    r = session.profile(2)
    assert r.timestamps is False and r.mode == profiler.MODE_CPU
    assert "timestamp-query" in r.note and "timestamp-query" in r.format_table()
    assert r.to_dict()["timestamps"] is False
    assert len(r.dispatches) == 2 * len(session.plan.dispatches) and all(d.gpu_ns > 0 for d in r.dispatches)
    path = tmp_path / "f.pftrace"
    write_perfetto(r, path)
    pb, tracks, events = read_perfetto(path)
    assert any("NO timestamp-query" in t.name for t in tracks.values())
    (meta,) = [ev for _, ev in events if ev.type == pb.TrackEvent.TYPE_INSTANT]
    values = {a.name: a for a in meta.debug_annotations}
    assert values["timestamps"].bool_value is False and "timestamp-query" in values["note"].string_value
    # Each dispatch is its own submission: one flow from each submit.
    with pytest.raises(MeganeuraError, match="needs a device feature"):
        profiler.profile_session(session, 1, mode=profiler.MODE_PER_PASS)


def test_meganeura_trace_env_writes_at_exit(session, monkeypatch, tmp_path, configure):
    path = tmp_path / "env.pftrace"
    configure(trace=str(path))
    session.profile(1, measure_overhead=False)
    assert profiler._ATEXIT  # the atexit hook is registered...
    profiler._write_env_trace()  # ...and this is what it runs
    _, tracks, _ = read_perfetto(path)
    assert any(t.name.startswith("GPU queue") for t in tracks.values())


def test_train_on_an_inference_session_is_a_clear_error(session):
    with pytest.raises(MeganeuraError, match="training"):
        session.profile(1, train=True)


def test_cli_profile_json_and_trace(capsys, tmp_path):
    trace = tmp_path / "t.pftrace"
    code = main(["profile", "mlp", "--steps", "2", "--json", "--trace", str(trace)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "profile step 2/2" in err
    d = json.loads(out)
    assert d["model"] == "mlp" and d["steps"] == 2 and d["timestamps"] is True
    assert isinstance(d["build_seconds"], float) and d["build_seconds"] > 0
    assert d["adapter"]["name"] and d["adapter"]["backend"]
    assert len(d["gpu_step_ns"]) == 2 and all(t > 0 for t in d["gpu_step_ns"])
    assert d["dispatches"] and {d_["step"] for d_ in d["dispatches"]} == {0, 1}
    for row in d["dispatches"]:
        assert {"step", "index", "kernel", "nodes", "gpu_ns", "bytes", "flops"} <= set(row)
    assert d["trace"] == str(trace) and trace.stat().st_size > 0
    _, tracks, _ = read_perfetto(trace)
    names = {t.name for t in tracks.values()}
    assert "live tensors (bytes)" in names


def test_cli_profile_train(capsys, tmp_path):
    trace = tmp_path / "train.pftrace"
    code = main(["profile", "mlp", "--steps", "2", "--train", "--set", "batch=4", "--json", "--trace", str(trace)])
    out, err = capsys.readouterr()
    assert code == 0, err
    d = json.loads(out)
    assert d["train"] is True and len(d["gpu_step_ns"]) == 2 and d["build_seconds"] > 0
    kernels = {row["kernel"] for row in d["dispatches"]}
    assert {"train:sum_squares", "train:norm_total"} <= kernels
    # mlp trains with AdamW and no weight decay: one group, one update per step naming its parameters
    updates = [row for row in d["dispatches"] if row["kernel"] == "train:adamw"]
    assert len(updates) == 2 and {row["step"] for row in updates} == {0, 1}
    assert set(updates[0]["nodes"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert updates[0]["archetype"] == "optimizer" and updates[0]["bytes"] > 0 and updates[0]["flops"] > 0
    assert all(row["gpu_ns"] > 0 for row in d["dispatches"])
    losses = [s["loss"] for s in d["step_details"]]
    assert all(isinstance(x, float) for x in losses)
    _, tracks, _ = read_perfetto(trace)
    assert "loss" in {t.name for t in tracks.values()}


def test_gpu_clock_anchored_to_submit_when_clocks_differ(session, monkeypatch):
    # lavapipe counts on the CPU's clock; shifting its ticks by an hour simulates a GPU
    # that does not: each step is then anchored to its submit and lies within the step.
    read = profiler.DispatchTimestamps.read
    monkeypatch.setattr(profiler.DispatchTimestamps, "read", lambda self: read(self) + 3_600_000_000_000)
    r = session.profile(2, measure_overhead=False)
    assert r.clock_alignment.startswith("first gpu timestamp")
    for s in r.step_records:
        ds = [d for d in r.dispatches if d.step == s.step]
        assert s.submit_start_ns <= min(d.begin_ns for d in ds)
        assert max(d.end_ns for d in ds) <= s.start_ns + s.wall_ns


@pytest.mark.parametrize("dims", [1, 2], ids=["conv1d", "conv2d"])
def test_convolution_flops_are_one_implicit_gemm_each(dims):
    """The forward convolution and both of its gradients are the same implicit GEMM:
    2 x (elements of the forward's output) x (weights of one filter) flops each. (The
    weight gradient's estimate was once ~1000x too high, which put a whisper-tiny
    training step at 115 'TFLOP/s'.)"""
    from engine.autodiff.gradients import differentiate
    g = Graph("conv")
    spatial = (20,) * dims
    x = g.parameter("x", (2, 3) + spatial)   # a parameter, so its gradient (conv_input_grad) is taken
    w = g.parameter("w", (5, 3) + (3,) * dims)
    conv = g.conv1d if dims == 1 else g.conv2d
    y = conv(x, w, stride=2, padding=1)
    g.output("loss", g.mean(g.apply("mul", y, y)))
    train, _ = differentiate(g)
    want = 2 * g[y].size * 3 * 3 ** dims
    got = {n.op: estimate_flops(train, n) for n in train.nodes if n.op.startswith("conv")}
    assert got == {f"conv{dims}d": want, "conv_input_grad": want, "conv_weight_grad": want}, (got, want)
