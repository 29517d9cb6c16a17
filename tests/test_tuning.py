"""Per-adapter tuning: the rules read ``Capabilities.tuning``, ``meganeura tune`` picks
winners by time and caches them per adapter, and plans on the adapter read them back."""

import json
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from engine import codegen
from engine.codegen import Tuning
from engine.cli.tune import format_tuning
from engine.codegen.matmul import coop_variant, vector_layout, vector_width
from engine.compile.plan import compile_plan
from engine.config import current, use
from engine.graph.ir import Graph
from engine.runtime import tuner
from engine.runtime.device import adapter_info, device_capabilities, get_device
from engine.runtime.tuning import adapter_tuning, read_tuning, tuning_key, write_tuning

ROOT = Path(__file__).resolve().parent.parent
SMALL_GPU = Tuning(matmul_resident=64, attention_fill=96, sum_workgroups=16, wide_fill=64, source="tuned")


@pytest.fixture
def own_cache(tmp_path):
    """The process's configuration with its caches in ``tmp_path`` (tuning there is private to the test)."""
    previous = use(replace(current(), cache_dir=str(tmp_path)))
    yield tmp_path
    use(previous)


def test_tuning_fields_are_checked():
    assert Tuning.from_dict(asdict(SMALL_GPU)) == SMALL_GPU
    with pytest.raises(ValueError, match="unknown tuning fields"):
        Tuning.from_dict({**asdict(SMALL_GPU), "sm_count": 132})
    with pytest.raises(ValueError, match="positive whole number"):
        Tuning(matmul_resident=0)
    assert set(codegen.TUNED_FIELDS) == {"matmul_resident", "attention_fill", "sum_workgroups", "lean_k",
                                         "dq_long_stream", "narrow_columns", "wide_fill", "dq_prefetch",
                                         "split_small_cost", "vector_small_kib", "vector_deep_columns"}
    assert set(tuner.LADDERS) == set(codegen.TUNED_FIELDS)


def test_kernel_rules_follow_the_tuning():
    """Whisper's weight gradient at batch 8 (36 tiles, K 12000) splits 14 ways where 512
    workgroups fill the GPU, not at all where 64 do; a 2048 x 1536 output takes the
    128 tile only on a GPU that its 192 tiles fill twice; attention splits by the fill."""
    assert codegen.matmul_splits(36, 12000, 16) == 14
    assert codegen.matmul_splits(36, 12000, 16, tuning=SMALL_GPU) == 1
    big, small = codegen.PLAIN, replace(codegen.PLAIN, tuning=SMALL_GPU)
    assert codegen.matmul_variant(2048, 1536, 1, 384, caps=big) == "64"
    assert codegen.matmul_variant(2048, 1536, 1, 384, caps=small) == "128k8u"
    assert coop_variant(512, 512, 1, k_=512) == "c64l" and coop_variant(512, 512, 1, SMALL_GPU, k_=8192) == "c128"
    assert coop_variant(512, 512, 1, SMALL_GPU, k_=2048) == "c128l"   # 4 slices of 512: short enough for the lean tile
    # weight gradients over K = 12000 rows: the 128-row tiles' slices aim for wide_fill (256)
    # workgroups: 36 tiles of 128 x 128 in 7 slices of 1714 (too long for the lean tile),
    # which 128 x 96 tiles fill in as many waves; 9 (144 in 16 slices of 750) take the lean tile
    assert coop_variant(384, 1536, 1, k_=12000) == "c96" and coop_variant(384, 384, 1, k_=12000) == "c128l"
    # aiming for 512 as the 64 x 64 tiles do (the rule until run 43): 14 slices of 857, and 9 tiles too few
    old_rule = Tuning(wide_fill=512)
    assert coop_variant(384, 1536, 1, old_rule, k_=12000) == "c128l" and coop_variant(384, 384, 1, old_rule,
                                                                                        k_=12000) == "c64l"
    assert coop_variant(384, 1536, 1, k_=1500) == "c64l"           # 5 slices of 36: too few
    assert coop_variant(384, 1536, 1, SMALL_GPU, k_=12000) == "c96"    # 36 tiles fill a quarter of 64 by themselves,
    # so K is not split, and is too long for the lean tile; 128 x 96 (48 tiles) takes as many waves of 16
    assert coop_variant(384, 1664, 1, SMALL_GPU, k_=12000) == "c128"   # N no multiple of 96
    assert codegen.matmul_variant(384, 1536, 1, 12000, True, caps=big) == "128k8u"    # the same in f32
    assert codegen.matmul_variant(384, 384, 1, 12000, True, caps=big) == "64t128"
    # gpt-tiny's (K = 2048) would take 8 slices of 256: too short for the larger tile
    assert coop_variant(256, 1024, 1, k_=2048) == "c64l" and coop_variant(384, 1536, 1, k_=2048) == "c64l"
    assert codegen.matmul_variant(384, 1536, 1, 2048, True, caps=big) == "64t128"
    assert codegen.attention_splits(47 * 6, 47) == 3
    assert codegen.attention_splits(47 * 6, 47, tuning=SMALL_GPU) == 1


def test_wide_fill_steers_the_slices_of_128_row_cooperative_tiles_only():
    """matmul_resident counts 64 x 64 workgroups; the K slices of 128 x 128 and 128 x 96
    cooperative tiles taken for their slices aim for wide_fill instead, so that tuning one
    leaves the other's products alone: gpt-tiny's weight gradients (64 x 64 tiles,
    K = 2048) split 3 ways from wide_fill 256 up (below, their slices would be long enough
    for 128 x 128 tiles), whisper's at batch 8 by it."""
    from engine.codegen.matmul import slice_fill
    variants = ("c128", "c128l", "c96", "c64", "c64l", "128k8u", "64")
    assert [slice_fill(v, 36) for v in variants] == [256] * 3 + [512] * 4
    assert slice_fill("c96", 48, Tuning(wide_fill=1024)) == 1024 and slice_fill("c64", 36, Tuning(wide_fill=1024)) == 512
    # 128-row tiles that a quarter of matmul_resident fills by count (not for their slices) keep it
    assert slice_fill("c128", 144) == 512 and slice_fill("c96", 127) == 256
    assert codegen.matmul_splits(36, 12000, 16, fill=256) == 7 and codegen.matmul_splits(36, 12000, 16) == 14
    caps = replace(codegen.PLAIN, subgroups=True, workgroup_storage=49152, dialect="tint", matmul_f16=True,
                   invocations=1024)

    def weight_gradient(m, n, k, tuning):
        g = Graph("weight gradient")
        g.output("dw", g.matmul(g.input("x", (k, m)), g.input("d", (k, n)), transpose_a=True))
        return compile_plan(g, loss=None, capabilities=replace(caps, tuning=tuning)).dispatches[0].variant

    for fill in (256, 512, 1024):
        assert "64x64 tile" in weight_gradient(384, 1536, 2048, Tuning(wide_fill=fill))
        assert "K split 3 ways" in weight_gradient(384, 1536, 2048, Tuning(wide_fill=fill))
    assert "128x96 tile" in weight_gradient(384, 1536, 12000, Tuning()) and "K split 5 ways" in weight_gradient(
        384, 1536, 12000, Tuning())                                  # 48 tiles of 128 x 96: 240 workgroups
    assert "K split 14 ways" in weight_gradient(384, 1536, 12000, Tuning(wide_fill=512))
    assert "128x128 tile" in weight_gradient(384, 1536, 2048, Tuning(wide_fill=128))


def _sum_plan(caps):
    g = Graph("bias gradient")
    g.output("s", g.apply("sum_to", g.input("x", (3000, 384)), shape=(384,)))
    return compile_plan(g, loss=None, capabilities=caps)


def test_plans_read_the_tuning_and_are_keyed_by_it():
    """A bias gradient of 384 outputs takes 16 lanes an output only where 16 x 24 workgroups fill the GPU."""
    default, tuned = _sum_plan(codegen.PLAIN), _sum_plan(replace(codegen.PLAIN, tuning=SMALL_GPU))
    assert default.dispatches[0].workgroups != tuned.dispatches[0].workgroups
    assert tuned.capabilities["tuning"] == asdict(SMALL_GPU)


def test_winner_must_beat_the_default_by_the_margin():
    rows = [{"value": 64, "ms": 0.99}, {"value": 512, "ms": 1.0}, {"value": 1024, "ms": 1.2}]
    assert tuner.pick_winner(rows, 512) == 512                       # 1% faster: noise
    rows[0]["ms"] = 0.9
    assert tuner.pick_winner(rows, 512) == 64
    assert tuner.pick_winner([{"value": 512, "ms": 1.0}, {"value": 128, "ms": 1.0}], 512) == 512


def test_winner_must_not_make_any_model_slower():
    """Each model's products count alike (their time relative to the default's), and a
    value that makes one model slower by more than the margin loses, however much it wins
    on another: run 43's matmul_resident 256 took 0.3 ms off whisper-tiny's b8 step (its
    long products) and put 0.2-0.3 ms on gpt-tiny's."""
    def row(value, whisper, gpt):
        return {"value": value, "ms": whisper + gpt, "groups": {"whisper": whisper, "gpt": gpt}}
    assert tuner.pick_winner([row(512, 10.0, 1.0), row(256, 8.0, 1.1)], 512) == 512
    assert tuner.pick_winner([row(512, 10.0, 1.0), row(256, 9.0, 1.02)], 512) == 256
    assert tuner.pick_winner([row(512, 10.0, 1.0), row(256, 9.0, 1.02), row(128, 9.9, 0.8)], 512) == 128
    assert tuner.pick_winner([row(512, 10.0, 1.0), row(256, 9.8, 1.0)], 512) == 512    # 1% on the mean
    groups = {w.group for w in tuner.LADDERS["matmul_resident"][1]}
    assert groups == {"whisper-tiny b8", "whisper-tiny b1", "gpt-tiny b8", "SmolLM2-135M 4x256", "SmolLM2-135M decode",
                      "Llama-3.2-1B decode", "other"}


def test_vector_products_follow_the_tuning():
    """A decode step's products (one row): B's columns contiguous and at least
    ``vector_small_kib`` take 32 columns a workgroup, K split while their workgroups are
    fewer than a wave of matmul ones (Llama-3.2-1B's SwiGLU weights, 256 workgroups: 4
    slices; its down projection, 64: 16); a smaller B, or one stored transposed, 8."""
    big, small = codegen.PLAIN, replace(codegen.PLAIN, tuning=SMALL_GPU)
    assert vector_layout(8192, 2048, 1, big, True, True) == (32, 4)
    assert vector_layout(2048, 8192, 1, big, True, True) == (32, 16)
    assert vector_layout(8192, 2048, 1, small, True, True) == (32, 1)       # 64 fill this GPU
    assert vector_layout(2048, 8192, 1, small, True, True) == (32, 1)
    assert vector_layout(8192, 2048, 1, big, False, True) == (8, 1)         # transposed: 1,024 workgroups
    assert vector_layout(2048, 8192, 1, big, True, False) == (32, 1)        # not splittable
    assert vector_layout(1536, 576, 1, big, True, True) == (8, 1)           # SmolLM2's: 3.4 MiB
    tuned = replace(codegen.PLAIN, tuning=Tuning(vector_small_kib=1))
    assert vector_layout(1536, 576, 1, tuned, True, True) == (32, 2)        # 48 workgroups, K for 2 slices
    huge = replace(codegen.PLAIN, tuning=Tuning(vector_small_kib=1 << 20))
    assert vector_layout(2048, 8192, 1, huge, True, True) == (8, 1)
    # bf16 weights, four columns a thread: a quarter of the workgroups, so K splits further
    assert vector_layout(8192, 2048, 1, big, True, True, width=4) == (32, 8)
    assert vector_layout(2048, 8192, 1, big, True, True, width=4) == (32, 16)
    assert vector_width(1, ["bf16", "bf16"], True, [8192, 8192], small=False) == 4
    assert vector_width(1, ["bf16", "f32"], True, [8192, 8192], small=False) == 1   # one B in f32
    assert vector_width(2, ["bf16"], True, [8192, 8192], small=False) == 1          # two rows
    assert vector_width(1, ["bf16"], True, [8190, 8190], small=False) == 1          # columns not in fours
    assert vector_width(1, ["bf16"], False, [8192, 8192], small=False) == 1         # B transposed
    assert vector_width(1, ["bf16"], True, [576, 576], small=True) == 1             # SmolLM2's: 3.4 MiB


def test_the_lean_tiles_follow_the_tuning():
    """Whether a cooperative product takes the lean tile is the tuning's ``lean_k`` against
    the K its workgroups run (a slice's where K is split)."""
    assert coop_variant(12000, 1536, 1, k_=384) == "c128l"
    assert coop_variant(12000, 1536, 1, Tuning(lean_k=256), k_=384) == "c128"
    assert coop_variant(12000, 768, 1, k_=1536) == "c96"                 # not lean: the wide tile of the shape
    assert coop_variant(12000, 768, 1, Tuning(lean_k=2048), k_=1536) == "c128l"
    assert coop_variant(12000, 384, 1, k_=384) == "c96"                  # lean, but narrow: 128 x 96 fills better
    assert coop_variant(12000, 384, 1, Tuning(lean_k=2048), k_=1536) == "c96"
    assert coop_variant(12000, 384, 1, Tuning(narrow_columns=1), k_=384) == "c128l"   # tuned: never over a short K
    assert coop_variant(12000, 768, 1, Tuning(narrow_columns=768), k_=384) == "c96"
    assert coop_variant(1024, 576, 1, k_=1536) == "c64l"                 # 3 slices of 512
    assert coop_variant(1024, 576, 1, Tuning(lean_k=511), k_=1536) == "c64"
    g = Graph("conv1 weight gradient")       # whisper's at batch 8: [384, 240] over K = 24000 in 16 slices
    node = g.apply("conv_weight_grad", g.input("x", [8, 80, 3000]), g.input("d", [8, 384, 3000]),
                   stride=(1,), padding=(1,), kernel=(3,))
    caps = replace(codegen.PLAIN, subgroups=True, workgroup_storage=49152, dialect="tint", matmul_f16=True,
                   invocations=1024)
    variant = lambda tuning: codegen.kernel_for(g, g[node], replace(caps, tuning=tuning)).notes["variant"]
    assert "128x128 tile, cooperative f16 16x16x16 -> f32, 16 subgroups" in variant(Tuning())
    assert "128x128 tile, cooperative f16 16x16x16 -> f32, 8 subgroups" in variant(Tuning(lean_k=2048))


def test_cooperative_fields_are_tuned_with_f16_asked_for(monkeypatch):
    """``lean_k`` steers cooperative kernels only: the tuner times it with f16 precision
    asked for, whatever the run's; ``split_small_cost`` with f32 on the cooperative units
    (the offered capabilities without f16); the other fields with the run's."""
    asked = {}

    def fake_tune_field(device, field, base, workloads, values, rng, progress=None, warm_seconds=0.0):
        asked[field] = base
        assert warm_seconds == 0.0        # a software adapter: nothing to warm
        return getattr(Tuning(), field), [], {}

    monkeypatch.setattr(tuner, "tune_field", fake_tune_field)
    monkeypatch.setattr(tuner, "_warm_up", lambda session, seconds: None)
    from engine.runtime import device as device_module
    precisions = []
    real = device_module.device_capabilities
    monkeypatch.setattr(device_module, "device_capabilities", lambda device, config=None: (
        precisions.append(config and config.precision), real(device, config))[1])   # offered_capabilities' call
    tuner.measure_tuning(software=True, fields=["sum_workgroups", "lean_k", "split_small_cost"])
    assert "f16" in precisions
    f16 = real(None, replace(current(), precision="f16"))
    # offered: the split f32 products come with the f16 units (their kernels take f16's)
    offered = replace(f16, tuning=Tuning(), matmul_split=f16.matmul_f16)
    assert asked["lean_k"] == offered
    assert asked["split_small_cost"] == replace(offered, matmul_f16=False)
    assert asked["sum_workgroups"] == replace(real(None), tuning=Tuning())


def test_tune_field_times_each_distinct_plan_once(monkeypatch):
    """Values giving the same dispatches are timed once; the fastest plan's value wins."""
    built, timed = [], []
    faster = {"16 lanes": 1.0}

    def fake_session(device, graph, plan, rng):
        built.append(plan)
        return plan

    def fake_time(plan):
        timed.append(plan)
        return faster["16 lanes"] if plan.dispatches[0].workgroups[0] < 30 else 2.0

    monkeypatch.setattr(tuner, "_session", fake_session)
    monkeypatch.setattr(tuner, "_time_ms", fake_time)
    workload = tuner._column_sum(3000, 384)
    base = replace(codegen.PLAIN, tuning=Tuning())
    unchanged = tuner._matmul(64, 64, 64)   # no sum_workgroups value changes its plan: not timed
    winner, rows, confirmation = tuner.tune_field(None, "sum_workgroups", base, [workload, unchanged],
                                                  (16, 24, 64, 512), None)
    assert [r["value"] for r in rows] == [16, 24, 64, 128, 512]   # the default is always tried
    assert len(built) == 4                      # 16 and 24 lanes: two plans, built again for the confirmation
    assert all(list(r["workloads"]) == [workload.name] for r in rows)
    assert winner == 16 and rows[0]["ms"] == 1.0 and rows[-1]["ms"] == 2.0
    assert len(timed) == 2 + 2 * tuner.CONFIRMATIONS and confirmation["kept"]

    def slower_when_timed_again(plan):      # a winner by noise: timed again, it loses
        timed.append(plan)
        if plan.dispatches[0].workgroups[0] >= 30:
            return 2.0
        return 1.0 if len(timed) <= 2 else 2.5

    events = []                             # on a GPU, each plan runs a while right before it is timed
    monkeypatch.setattr(tuner, "_warm_up", lambda session, seconds: events.append(("warm", session, seconds)))
    monkeypatch.setattr(tuner, "_time_ms", lambda session: events.append(("time", session)) or 1.0)
    tuner.tune_field(None, "sum_workgroups", base, [workload], (16, 512), None, warm_seconds=0.2)
    assert [e[0] for e in events] == ["warm", "time"] * 2 and all(e[2] == 0.2 for e in events[::2])
    assert all(w[1] is t[1] for w, t in zip(events[::2], events[1::2]))
    events.clear()                          # a confirmation: one warm-up, then its timings back to back
    monkeypatch.setattr(tuner, "_time_ms", lambda session: events.append(("time", session)) or (
        1.0 if session.dispatches[0].workgroups[0] < 30 else 2.0))
    tuner.tune_field(None, "sum_workgroups", base, [workload], (16, 512), None, warm_seconds=0.2)
    assert [e[0] for e in events] == ["warm", "time"] * 2 + ["warm"] + ["time"] * 2 * tuner.CONFIRMATIONS

    timed.clear()
    monkeypatch.setattr(tuner, "_time_ms", slower_when_timed_again)
    winner, _, confirmation = tuner.tune_field(None, "sum_workgroups", base, [workload], (16, 512), None)
    assert winner == 128 and confirmation == {"winner": 16, "winner_ms": [2.5] * 3, "default_ms": [2.0] * 3,
                                              "kept": False}


def _small_session():
    """A tuner session of a 48 x 40 x 96 matmul on this adapter, and its output after one run."""
    import numpy as np
    g = tuner._graph(tuner._matmul(48, 40, 96))
    session = tuner._session(get_device(), g, compile_plan(g, loss=None, capabilities=device_capabilities()),
                             np.random.default_rng(0))
    return session, session.read_output("c")


def test_warming_up_runs_the_plan_in_batches_and_changes_nothing(monkeypatch):
    """``_warm_up`` records ``WARM_UP_BATCH`` steps a command encoder for as long as asked;
    the session's results stay what one run gives."""
    import numpy as np
    session, before = _small_session()
    encoders = []
    real_record = session.record
    monkeypatch.setattr(session, "record", lambda encoder: encoders.append(encoder) or real_record(encoder))
    tuner._warm_up(session, 0.01)
    batches = [encoders.count(e) for e in dict.fromkeys(encoders)]
    assert batches and all(n == tuner.WARM_UP_BATCH for n in batches), batches
    np.testing.assert_array_equal(session.read_output("c"), before)


def test_the_tuners_clock_brackets_a_plans_runs_with_two_timestamps(monkeypatch):
    """``_time_ms`` records each timing's ``BRACKETED_RUNS`` runs into one compute pass
    between its two timestamps (none between dispatches, as a model's step runs them: a
    timestamp around each dispatch charged a split kernel's second one about 8 us on the
    H100); the results stay what one run gives. A training plan copies its statistics
    between dispatches: record_bracketed refuses it, and it is profiled instead."""
    import numpy as np
    from engine import models
    from engine.train.session import build_session
    session, before = _small_session()
    runs = []
    real = session.record_bracketed
    monkeypatch.setattr(session, "record_bracketed", lambda enc, writes, n: runs.append(n) or real(enc, writes, n))
    monkeypatch.setattr(session, "profile", lambda **options: pytest.fail("profiled"))
    assert tuner._time_ms(session) > 0 and runs == [tuner.BRACKETED_RUNS] * tuner.STEPS
    np.testing.assert_array_equal(session.read_output("c"), before)
    training = build_session(models.create("mlp", ["batch=4"]).build(train=True))
    encoder = training.device.create_command_encoder()
    with pytest.raises(ValueError, match="copies between dispatches"):
        training.record_bracketed(encoder, {}, 1)
    profiled = type("Report", (), {"gpu_step_ns": [3_000_000, 1_000_000, 2_000_000]})()
    monkeypatch.setattr(training, "profile", lambda **options: profiled)
    assert tuner._time_ms(training) == 2.0


def test_tuning_cache_is_keyed_and_tolerates_garbage(tmp_path):
    info = {"name": "Some GPU", "description": "driver 1.2", "backend": "Vulkan", "wgpu": "native"}
    key = tuning_key(info)
    assert adapter_tuning(info, tmp_path) == Tuning()
    path = write_tuning(key, {"tuning": asdict(SMALL_GPU), "measurements": {}}, tmp_path)
    assert adapter_tuning(info, tmp_path) == SMALL_GPU
    assert adapter_tuning({**info, "description": "driver 1.3"}, tmp_path) == Tuning()   # a new driver: untuned
    path.write_text(json.dumps({"key": key, "tuning": {"tuning": {"matmul_resident": -5}}}))
    assert read_tuning(key, tmp_path) is None and adapter_tuning(info, tmp_path) == Tuning()
    path.write_text("{not json")
    assert adapter_tuning(info, tmp_path) == Tuning()


def test_tune_on_this_adapter_caches_what_plans_then_use(own_cache):
    """A real (software-sized) run on lavapipe: winners cached under the adapter's key,
    and the capabilities of the next plans carry them."""
    result = tuner.tune(fields=["sum_workgroups"])
    assert Path(result["path"]).parent == own_cache / "tuning"
    rows = result["measurements"]["sum_workgroups"]
    assert {r["value"] for r in rows} >= {16, 128, 512} and all(r["ms"] > 0 for r in rows)
    tuned = Tuning.from_dict(result["tuning"])
    assert tuned.source == "tuned" and tuned.sum_workgroups in {r["value"] for r in rows}
    assert read_tuning(tuning_key(adapter_info()))["tuning"] == result["tuning"]
    assert device_capabilities().tuning == tuned


def test_tune_command_json(tmp_path):
    """``meganeura tune --show --json`` before and after ``--reset`` (the measuring run is
    the test above, in process: a second one here would double its time)."""
    env = {**__import__("os").environ, "MEGANEURA_CACHE": str(tmp_path)}
    info = adapter_info()
    write_tuning(tuning_key(info), {"tuning": asdict(SMALL_GPU), "defaults": asdict(Tuning()),
                                    "measurements": {}}, tmp_path / "tuning")

    def run(*args):
        proc = subprocess.run([sys.executable, "-m", "engine", "tune", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc

    shown = json.loads(run("--show", "--json").stdout)
    assert shown["cached"] and shown["tuning"] == asdict(SMALL_GPU) and shown["adapter"]["name"] == info["name"]
    assert "matmul_resident       64   (default 512)" in format_tuning(shown)
    shown = json.loads(run("--reset", "--json").stdout)
    assert not shown["cached"] and shown["tuning"] == asdict(Tuning())
    assert not Path(shown["path"]).exists()


def test_a_models_products_join_the_matmul_ladders(monkeypatch, capsys):
    """``meganeura tune SOURCE`` adds the distinct products of SOURCE's training step (as a
    session compiles it: q/k/v stacked, rows of every batch flattened where the weight is
    shared) to the matmul fields' workloads, as one more model none of them may slow; each
    workload builds the product it names. --show and --reset with SOURCE are refused."""
    import argparse
    import numpy as np
    from engine import models
    from engine.cli import tune as tune_command
    from engine.errors import MeganeuraError
    from engine.graph import reference
    products = tuner.model_products(models.create("whisper-tiny", ["batch=2", "mel_len=3000"]), "mine")
    assert {w.group for w in products} == {"mine"}
    assert sorted(w.name for w in products) == sorted(
        ["matmul 3 x 3000x384x384", "matmul 3000x384x384", "matmul 3000x1536x384", "matmul 3000x384x1536",
         "matmul 1536x384x3000 (Aᵀ)", "matmul 3000x1536x384 (Bᵀ)", "matmul 384x1536x3000 (Aᵀ)",
         "matmul 3000x384x1536 (Bᵀ)", "matmul 384x384x3000 (Aᵀ)", "matmul 3000x384x384 (Bᵀ)",
         "matmul 3000x384x1152 (Bᵀ)", "matmul 1152x384x3000 (Aᵀ)"])
    rng = np.random.default_rng(0)
    for w in (tuner._matmul(24, 20, 16, batch=(1, 3)), tuner._matmul(24, 20, 16, transpose_b=True),
              tuner._matmul(24, 20, 16, True)):
        g = tuner._graph(w)
        inputs = {n: rng.standard_normal(g[i].shape).astype(np.float32) for n, i in g.inputs.items()}
        out = reference.run(g, inputs, {}, np.float64)["c"]
        assert out.shape[-2:] == (24, 20) and out.size == 24 * 20 * (3 if "3 x" in w.name else 1), w.name
    timed = {}
    monkeypatch.setattr(tuner, "tune", lambda progress=None, products=(): timed.setdefault("products", products) and {
        "tuning": asdict(Tuning()), "defaults": asdict(Tuning()), "measurements": {}, "models": ["mine"]})
    args = argparse.Namespace(model="gpt-tiny", settings=["batch=1", "seq=8"], inference=False, loss=None,
                              target=None, json=True, show=False, reset=False)
    assert tune_command._tune(args) == 0
    assert {w.group for w in timed["products"]} == {"gpt-tiny batch=1 seq=8"} and len(timed["products"]) > 4
    assert "join the matmul fields' workloads" in capsys.readouterr().err
    with pytest.raises(MeganeuraError, match="--show measures nothing"):
        tune_command._tune(argparse.Namespace(**{**vars(args), "show": True}))
    shown = {"adapter": {"name": "GPU", "backend": "Vulkan", "wgpu": "dawn"}, "tuning": asdict(Tuning()),
             "defaults": asdict(Tuning()), "models": ["gpt-tiny b8", "mine"], "path": "tuning.json"}
    assert "Models   gpt-tiny b8, mine (none of their products may get slower)" in format_tuning(shown)


def test_deep_columns_are_tuned_on_real_plans_of_weights_kept_out_in():
    """``vector_deep_columns`` on the software ladder's stack (bf16 weights kept [out, in]):
    each value a plan of its own, run on lavapipe, and a winner among them."""
    from engine.runtime.device import get_device
    work = tuner.LADDERS["vector_deep_columns"][2]
    base = replace(codegen.PLAIN, tuning=Tuning())
    winner, rows, _ = tuner.tune_field(get_device(), "vector_deep_columns", base, work, (1, 2, 4),
                                       np.random.default_rng(0))
    assert [r["value"] for r in rows] == [1, 2, 4] and all(r["ms"] > 0 for r in rows)
    assert winner in (1, 2, 4)
    graph = tuner._graph(work[0])
    variants = {columns: {codegen.kernel_for(graph, n, replace(base, tuning=Tuning(vector_deep_columns=columns)))
                          .notes["variant"] for n in graph.nodes if n.op == "matmul"} for columns in (1, 2, 4)}
    assert all("4 K steps a load" in v for vs in variants.values() for v in vs), variants
    assert {columns for columns, vs in variants.items() if any("columns a thread" in v for v in vs)} == {2, 4}
