"""Save a screenshot of every Studio panel to docs/screenshots/*.png.

    .venv/bin/python scripts/screenshots.py [OUT_DIR]

Runs offscreen when there is no display; uses a throwaway QSettings file.
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

    w.load_model("whisper-tiny", {"mel_len": 64})
    wait(app, idle, 120)
    w.graph_view.kind_box.setCurrentIndex(2)
    save(w.graph_view, "graph_training")
    g = w.graph_view
    some = next(i for i, n in enumerate(g.graph.nodes) if n.op == "matmul")
    g.items[some].setSelected(True)
    g.canvas.resetTransform()
    g.canvas.auto_fit = False
    g.canvas.centerOn(g.items[some])
    save(w.graph_view, "graph_training_zoomed")

    w.load_model("gpt-tiny", {"seq": 16})
    w.graph_view.kind_box.setCurrentIndex(1)          # optimized
    wait(app, lambda: idle() and w.state.graphs.get("optimized") is not None, 120)
    table = w.fusion_panel.table
    rows = {table.item(r, 0).text(): r for r in range(table.rowCount())}
    table.selectRow(rows.get("attention_decomposed", 0))
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

    w.load_model("mlp", {"batch": 32})
    wait(app, idle, 120)
    w.training_panel.steps.setValue(150)
    w.training_panel.lr.setValue(0.003)
    w.start_training()
    wait(app, lambda: w.training_panel.worker is None, 300)
    save(w, "training")
    w.tabs.setCurrentWidget(w.doctor)
    save(w.doctor, "device")
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
