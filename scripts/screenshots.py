"""Save a screenshot of every Studio panel to docs/screenshots/*.png.

    .venv/bin/python scripts/screenshots.py [OUT_DIR]

Runs offscreen when there is no display; uses a throwaway QSettings file.
GPT_TINY_WEIGHTS=FILE: gpt-tiny weights trained on its corpus (``meganeura train gpt-tiny
--save FILE``) make the Generate tab continue its prompt in sentences; without, random weights.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


def wait(app, condition, timeout=60.0):
    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        app.processEvents()
        time.sleep(0.01)
    for _ in range(5):
        app.processEvents()
    return condition()


def tiny_llama_checkpoint() -> str:
    """A Llama checkpoint folder written by transformers (grouped-query attention, tied
    embeddings, 4 layers), as a user would open one."""
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True)
    path = os.path.join(tempfile.mkdtemp(), "tiny-llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def windowed_mistral_checkpoint() -> str:
    """A Mistral checkpoint folder whose sliding window (64 tokens) bounds its sequences:
    the model panel says why."""
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                     sliding_window=64)
    path = os.path.join(tempfile.mkdtemp(), "tiny-mistral")
    transformers.MistralForCausalLM(cfg).save_pretrained(path)
    return path


def smollm2_shaped_checkpoint(vocab: int = 49152) -> str:
    """A Llama checkpoint folder of SmolLM2-135M's shape (bench/bench_checkpoint.py's
    SMOLLM2_135M: hidden 576, 30 layers, 9 heads over 3, intermediate 1536, tied), random
    weights."""
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                                   rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
    path = os.path.join(tempfile.mkdtemp(), "smollm2-135m-shaped")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def shoot_big_model(app, w, save) -> None:
    """A SmolLM2-135M-shaped Llama: its graph on its blocks, one layer opened, coloured
    by GPU time after a forward profile, and the profiler's per-module table."""
    from PySide6.QtCore import Qt
    w.load_model(smollm2_shaped_checkpoint(), {"seq": 32})
    wait(app, lambda: w.fusion_panel.worker is None and w.graph_view.graph is w.state.graphs.get("optimized"), 300)
    w.tabs.setCurrentWidget(w.graph_view)
    g = w.graph_view
    g.canvas.home()
    save(w, "graph_llama_blocks")
    g.expand("model.layers.3.self_attn")
    g.select_module("model.layers.3.self_attn")
    save(w, "graph_llama_layer_open")
    g.collapse_all()
    run_profile(app, w, 3)
    w.tabs.setCurrentWidget(g)
    g.canvas.home()
    save(w, "graph_llama_heat")
    g.expand("model.layers.3.mlp")
    g.select_module("model.layers.3.mlp")
    save(w, "graph_llama_heat_layer")
    p = w.profiler_panel
    w.tabs.setCurrentWidget(p)
    p.tables.setCurrentWidget(p.module_table)
    p.module_table.table.sortByColumn(3, Qt.SortOrder.DescendingOrder)     # where the time goes
    save(w, "profiler_modules")


def fixture_runs(folder: Path) -> Path:
    """Three gpt-tiny run directories, written with the engine's RunDirectory as
    ``train --run-dir`` writes them: noisy losses falling from ln(257), validation every
    50 steps, a checkpoint every 200; two finished (the faster learning rate overfits
    late), one still running."""
    import json

    import numpy as np

    from engine.train.run_dir import RunDirectory
    rng = np.random.default_rng(7)
    runs = (("gpt-tiny-20261126-091500", 1e-3, 600, 1.95, 140, 0.0, "finished"),
            ("gpt-tiny-20261126-104000", 3e-3, 600, 1.80, 60, 0.35, "finished"),
            ("gpt-tiny-20261126-113200", 3e-4, 350, 2.10, 330, 0.0, "running"))
    for seed, (name, lr, done, floor, tau, overfit, status) in enumerate(runs):
        created = f"2026-11-26T{name[-6:-4]}:{name[-4:-2]}:{name[-2:]}+00:00"
        run = RunDirectory.create(folder / name, {
            "created": created, "model": {"source": "gpt-tiny", "name": "gpt-tiny", "settings": {"seq": 256}},
            "data": {"train": "data/tiny-shakespeare.txt", "val_fraction": 0.05},
            "train": {"optimizer": "adamw", "lr": lr, "steps": 600, "batch_size": 8, "seed": seed},
            "seed": seed, "eval_every": 50, "save_every": 200})
        for step in range(1, done + 1):
            mean = floor + (np.log(257) - floor) * np.exp(-step / tau)
            row = {"step": step, "loss": float(mean * (1 + rng.normal(0, 0.035 + 0.02 * overfit))), "lr": lr,
                   "grad_norm": float(abs(rng.normal(1.2, 0.3))),
                   "seconds": float(0.085 * (1 + abs(rng.normal(0, 0.1))))}
            if step % 50 == 0:
                row["val_loss"] = float(mean + 0.06 + overfit * max(0.0, step - 250) / 350 + rng.normal(0, 0.01))
            run.append_metrics(row)
            if step % 200 == 0:
                (run.path / f"checkpoint-{step}").mkdir()
                (run.path / f"checkpoint-{step}" / "state.json").write_text(json.dumps({"step": step}))
        run.write_status(status, done)
    return folder


def shoot_runs(app, w, save) -> None:
    """The Runs tab on three fixture runs, smoothing 0.8, a finished run selected (Resume
    enabled), the mouse over step 330."""
    from PySide6.QtCore import QPointF

    p = w.runs_panel
    p.set_folder(fixture_runs(Path(tempfile.mkdtemp()) / "runs"))
    p.smoothing.setValue(800)
    p.table.setCurrentItem(p.table.topLevelItem(1))
    w.tabs.setCurrentWidget(p)
    wait(app, lambda: False, 0.3)
    view = p.plot.getPlotItem().vb
    p._mouse_moved(view.mapViewToScene(QPointF(330, 3.0)))
    save(w, "runs_panel")


def shoot_training(app, w, save, idle) -> None:
    """The Training tab after 150 steps of mlp on a user's .npz chosen with Data… (its
    run directory in a temp folder)."""
    from engine import models

    folder = Path(tempfile.mkdtemp())
    w.qsettings.setValue("runs/folder", str(folder / "runs"))
    data = models.create("mlp", ["samples=2048", "noise=1.5"]).dataset(5)
    import numpy as np
    np.savez(folder / "digits-train.npz", **data)
    w.load_model("mlp", {"batch": 32})
    wait(app, idle, 120)
    w.training_panel.set_data(str(folder / "digits-train.npz"))
    w.training_panel.steps.setValue(150)
    w.training_panel.lr.setValue(0.003)
    w.start_training()
    wait(app, lambda: w.training_panel.worker is None, 300)
    save(w, "training")


def shoot_open_dialog(w, save) -> None:
    """The dialog that reads a checkpoint's weights, halfway through a 1B model's 2.3 GiB
    (a tiny checkpoint reads before the dialog would show)."""
    from app.window import WeightsProgress
    reading = WeightsProgress(w, "Llama-3.2-1B")
    reading.dialog.show()
    reading(1236337064, 2471645608)
    save(reading.dialog, "open_checkpoint")
    reading.close()


def generate_shot(app, w, save, name: str, prompt: str, max_new: int, temperature: float, top_p: float = 1.0) -> None:
    """The Generate tab of the open model at 1400x900 (the Fusion report closed, as it has
    nothing to say here) after a generation from ``prompt``, saved as ``name``."""
    p = w.generate_panel
    w.tabs.setCurrentWidget(p)
    size = w.size()
    w.fusion_dock.hide()
    wait(app, lambda: False, 0.2)
    w.resize(1400, 900)
    p.prompt.setPlainText(prompt)
    p.max_new.setValue(max_new)
    p.temperature.setValue(temperature)
    p.top_p.setValue(top_p)
    p.seed.setValue(1)
    p.generate()
    wait(app, lambda: p.worker is None, 300)
    save(w, name)
    w.fusion_dock.show()
    w.resize(size)


def shoot_generate(app, w, save, idle) -> None:
    """96 tokens sampled from gpt-tiny on the Studio's default backend: the text streamed
    after the prompt and each decode step's time plotted."""
    w.load_model("gpt-tiny", {"seq": 16})
    wait(app, idle, 120)
    if os.environ.get("GPT_TINY_WEIGHTS"):
        w.load_weights(os.environ["GPT_TINY_WEIGHTS"])
    generate_shot(app, w, save, "generate", "the cat ", 96, 0.7, 0.9)


def shoot_generate_ids(app, w, save, idle) -> None:
    """A checkpoint folder without a tokenizer.json (a small Llama, random weights): the
    prompt given as ids, the new ids shown as ids."""
    w.load_model(tiny_llama_checkpoint(), {"seq": 16})
    wait(app, idle, 120)
    generate_shot(app, w, save, "generate_ids", "1, 17, 42, 300", 32, 0.0)


def run_profile(app, w, steps: int, train: bool = False) -> None:
    """A profile of the open model in the Profiler tab, waited for."""
    p = w.profiler_panel
    p.steps.setValue(steps)
    p.mode.setCurrentIndex(1 if train else 0)
    w.start_profile()
    wait(app, lambda: p.worker is None and w.state.profile is not None, 300)


def shoot_profile_views(app, w, save) -> None:
    """Roofline, Compare and Memory: the roofline of the whisper-tiny profile on screen
    with its slowest kernel selected; this profile (A, batch 1) against batch 2 (B); the
    memory of an mlp training step."""
    p = w.profiler_panel
    w.tabs.setCurrentWidget(p)
    p.tables.setCurrentWidget(p.roofline)
    p.select_kernel(max(p.roofline.positions, key=lambda n: p.roofline.rows[n]["gpu_ns"]))
    save(w, "profiler_roofline")
    saved = p.save_profile_json(os.path.join(tempfile.mkdtemp(), "whisper-tiny-batch1.json"))
    w.load_model("whisper-tiny", {"mel_len": 64, "batch": 2})
    wait(app, lambda: w.state.graphs.get("optimized") is not None and w.fusion_panel.worker is None, 120)
    run_profile(app, w, 10)
    p.load_comparison(saved)
    save(w, "profiler_compare")
    w.load_model("mlp", {"batch": 512})   # activations beside the weights, and quick on lavapipe
    wait(app, lambda: w.state.graphs.get("optimized") is not None and w.fusion_panel.worker is None, 120)
    run_profile(app, w, 2, train=True)
    p.tables.setCurrentWidget(p.memory)
    save(w, "profiler_memory")


def main(argv=None) -> int:
    from PySide6.QtCore import QSettings, Qt
    from PySide6.QtWidgets import QApplication, QMessageBox

    from app.window import MainWindow

    out = Path((argv or sys.argv[1:] or [ROOT / "docs" / "screenshots"])[0])
    out.mkdir(parents=True, exist_ok=True)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    QMessageBox.critical = lambda parent, title, text, *a, **k: print(f"error dialog: {title}: {text}")
    settings = QSettings(os.path.join(tempfile.mkdtemp(), "studio.ini"), QSettings.Format.IniFormat)
    w = MainWindow("audio-align", settings=settings)
    w.resize(1500, 900)
    w.show()
    wait(app, lambda: False, 0.3)

    def save(widget, name):
        wait(app, lambda: False, 0.2)
        path = out / f"{name}.png"
        widget.grab().save(str(path))
        print(path)

    def idle():
        return all(p.worker is None for p in (w.fusion_panel, w.profiler_panel, w.training_panel))

    wait(app, lambda: idle() and w.state.graphs.get("optimized") is not None, 120)
    save(w, "studio")
    save(w.model_panel, "model_panel")

    w.graph_view.kind_box.setCurrentIndex(0)          # original
    w.graph_view.search.setText("attention")
    save(w.graph_view, "graph_original")
    w.graph_view.search.setText("")

    # a Hugging Face checkpoint opened from its folder: a small Llama (random weights)
    w.load_model(tiny_llama_checkpoint(), {"seq": 32})
    w.graph_view.kind_box.setCurrentIndex(1)          # optimized
    wait(app, lambda: idle() and w.state.graphs.get("optimized") is not None, 120)
    save(w, "studio_checkpoint")
    save(w.model_panel, "model_panel_checkpoint")
    shoot_open_dialog(w, save)
    # a windowed checkpoint: its sequences stop at the window, and the panel says why
    w.load_model(windowed_mistral_checkpoint(), {"seq": 64})
    wait(app, lambda: idle() and w.state.graphs.get("optimized") is not None, 120)
    save(w.model_panel, "model_panel_window")

    w.load_model("whisper-tiny", {"mel_len": 64})
    wait(app, idle, 120)
    w.graph_view.kind_box.setCurrentIndex(2)
    save(w.graph_view, "graph_training")
    g = w.graph_view
    some = next(i for i, n in enumerate(g.graph.nodes) if n.op == "matmul")
    g.select([some])                                  # opens the block that holds it
    g.canvas.resetTransform()
    g.canvas.auto_fit = False
    g.canvas.centerOn(g.items[some])
    save(w.graph_view, "graph_training_zoomed")

    w.load_model("gpt-tiny", {"seq": 16})
    w.graph_view.kind_box.setCurrentIndex(1)          # optimized
    wait(app, lambda: idle() and w.state.graphs.get("optimized") is not None, 120)
    table = w.fusion_panel.table
    rows = {table.item(r, 0).text(): r for r in range(table.rowCount())}
    table.selectRow(rows["stacked_products"])          # the pass after the rules: q, k, v as one product
    save(w.fusion_panel, "fusion_panel")
    save(w, "studio_fusion")

    # profiler: whisper-tiny forward, 10 steps; then a dispatch row selects its node
    w.load_model("whisper-tiny", {"mel_len": 64})
    wait(app, lambda: idle() and w.state.graphs.get("optimized") is not None, 120)
    w.profiler_panel.steps.setValue(10)
    w.start_profile()
    wait(app, lambda: w.profiler_panel.worker is None and w.state.profile is not None, 300)
    save(w, "profiler")
    p = w.profiler_panel
    p.tables.setCurrentWidget(p.dispatch_table)
    p.dispatch_table.sortByColumn(5, Qt.SortOrder.DescendingOrder)
    save(p, "profiler_dispatches")
    p.dispatch_table.selectRow(0)
    w.tabs.setCurrentWidget(w.graph_view)
    save(w, "graph_profiled_node")
    shoot_profile_views(app, w, save)
    shoot_big_model(app, w, save)

    shoot_generate(app, w, save, idle)
    shoot_generate_ids(app, w, save, idle)
    shoot_training(app, w, save, idle)
    shoot_runs(app, w, save)
    w.tabs.setCurrentWidget(w.doctor)
    save(w.doctor, "device")
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
