"""Generate: text from the open causal language model with a KV cache, streamed token by token.

A prompt (text through the model's tokenizer, or token ids), the sampling settings and
Generate, which becomes Stop while it runs. The run is ``Generator.generate`` in a
superqt ``thread_worker``; its ``on_token`` callback appends (id, ms) to a list that the
UI's 25 Hz timer reads, so no Python object crosses threads through a queued signal
per token (PySide6 mis-counted references of those: tests/test_qt_threads.py), and a
fast GPU's hundreds of tokens a second arrive in a few batches per redraw. Stop sets
the ``threading.Event`` the generator checks before each decode step.

The output shows the prompt and, after it in the accent colour and bold, the new text
(``TextStream`` holds back a character split across tokens); beside it the read-outs
(tokens, prefill, decode tokens/s, why it stopped) and a plot of each decode step's
milliseconds. The generator keeps its compiled sessions between runs; it is dropped
when another model opens, new weights arrive or the backend changes, and built again
at the next Generate. A model that does not generate says so and disables the panel.
"""

from __future__ import annotations

import re
import statistics
import threading

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt, QTimer, Signal
from PySide6.QtGui import QFont, QKeySequence, QShortcut, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (QComboBox, QDoubleSpinBox, QFormLayout, QGroupBox, QHBoxLayout, QLabel,
                               QPlainTextEdit, QPushButton, QSpinBox, QSplitter, QTextEdit, QVBoxLayout, QWidget)
from superqt.utils import thread_worker

from engine.errors import MeganeuraError
from engine.train.generation import GREEDY_BATCH, Sampling

from .training_panel import BACKEND_LABELS, StepAxis, default_backend

PROMPT_KINDS = {"text": "Text", "ids": "Token ids"}
DEFAULT_NEW_TOKENS = 64
DEFAULT_PROMPT = "the cat "
ACCENT, MEDIAN = "#2f6fce", "#d1495b"     # the per-token curve, its median line
PLOT_TITLE = "Time per decode step"
OUTPUT_LABEL = {"text": "Output: the prompt, then the generated text in bold",
                "ids": "Output: the prompt, then the generated ids in bold (no tokenizer.json to make text of them)"}
STOP_REASONS = {"eos": "end-of-sequence token", "length": "reached max new tokens", "cancelled": "stopped by you"}


def parse_prompt_ids(text: str) -> list[int]:
    """Token ids typed as integers separated by commas or white space."""
    parts = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise MeganeuraError(f"the prompt {text.strip()[:40]!r} is not token ids: give integers separated by "
                             f"commas or spaces, e.g. 1, 2, 3") from None


BUILD_TIP = ("Building what this generation runs: the prefill and decode graphs optimized and compiled (from the "
             "cache on disk after the first time) and the weights uploaded. Kept for the next generation from the "
             "same weights.")


def build_text(seconds: float) -> str:
    """The Build read-out: what building the sessions took, or that an earlier generation built them."""
    return f"{seconds:,.2f} s" if seconds else "kept from the last generation"


WEIGHTS_TIP = ("Weight matrices the GPU keeps in bf16, exactly as the checkpoint stores them: half the memory and "
               "half the bytes a decode step reads. The kernels widen them to f32 as they read them, so the results "
               "are those of f32 weights, bit for bit.")


@thread_worker
def generation_run(generator, prompt, max_new_tokens, sampling, eos_ids, arrived: list, stop: threading.Event):
    """The ``Generation``; each token's (id, ms) is appended to ``arrived`` as it comes."""
    return generator.generate(prompt, max_new_tokens, sampling, eos_ids,
                              on_token=lambda token, ms: arrived.append((token, ms)), should_stop=stop)


class GeneratePanel(QWidget):
    failed = Signal(str, object)          # title, exception -> error dialog
    generationFinished = Signal(str)      # the Generation's ``stopped`` ("eos", "length", "cancelled") or "failed"

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.worker = None
        self.result = None                # the last Generation
        self.generator = None             # built lazily; dropped when the model, weights or backend change
        self.batched = False              # the last generation ran ahead on the GPU (greedy): ms per batch
        self.tokenizer = None
        self.can_run = lambda: True       # the window vetoes a run while training or a profile uses the GPU
        self.arrived: list[tuple[int, float]] = []
        self.shown = 0
        self.stream = None
        self.generated_text = ""
        self.shown_prompt = ""
        self.prompt_ids: list[int] = []
        self.max_new_tokens = 0
        self._stop = threading.Event()
        self._end_reason = "failed"

        self.notice = QLabel("")
        self.notice.setObjectName("generateNotice")
        self.notice.setWordWrap(True)
        self.notice.setTextFormat(Qt.TextFormat.PlainText)
        self.prompt = QPlainTextEdit(DEFAULT_PROMPT)
        self.prompt.setObjectName("promptBox")
        self.prompt.setPlaceholderText("Type a prompt; Ctrl+Enter generates")
        self.prompt.setMaximumHeight(110)
        for keys in ("Ctrl+Return", "Ctrl+Enter"):
            QShortcut(QKeySequence(keys), self.prompt, self.generate, context=Qt.ShortcutContext.WidgetShortcut)
        self.button = QPushButton("Generate")
        self.button.setObjectName("generateButton")
        self.button.setToolTip("Generate (Ctrl+Enter in the prompt); Stop while it runs")
        self.button.clicked.connect(self.toggle)

        left = QVBoxLayout()
        left.addWidget(self._settings_box())
        left.addWidget(self.button)
        left.addWidget(self._readouts_box())
        left.addStretch(1)
        side = QWidget()
        side.setLayout(left)
        side.setMaximumWidth(320)
        right = QVBoxLayout()
        right.addWidget(QLabel("Prompt"))
        right.addWidget(self.prompt)
        right.addWidget(self._output_and_plot(), 1)
        body = QHBoxLayout()
        body.addWidget(side)
        body.addLayout(right, 1)
        layout = QVBoxLayout(self)
        layout.addWidget(self.notice)
        layout.addLayout(body, 1)

        self.redraw_timer = QTimer(self)
        self.redraw_timer.setInterval(40)
        self.redraw_timer.timeout.connect(self.redraw)
        state.modelChanged.connect(self._model_changed)
        state.paramsChanged.connect(self.drop_generator)
        self._model_changed()

    # ------------------------------------------------------------ building

    def _settings_box(self) -> QGroupBox:
        """How the prompt is read and how tokens are chosen; ``self.controls``, which a run disables."""
        self.prompt_kind = QComboBox()
        for key, label in PROMPT_KINDS.items():
            self.prompt_kind.addItem(label, key)
        self.max_new = QSpinBox()
        self.max_new.setRange(1, 1 << 20)
        self.max_new.setValue(DEFAULT_NEW_TOKENS)
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.0, 5.0)
        self.temperature.setSingleStep(0.1)
        self.temperature.setSpecialValueText("0 (greedy)")
        self.temperature.valueChanged.connect(lambda _: self._update_controls())
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 1 << 24)
        self.top_k.setSpecialValueText("0 (all)")
        self.top_p = QDoubleSpinBox()
        self.top_p.setRange(0.01, 1.0)
        self.top_p.setSingleStep(0.05)
        self.top_p.setValue(1.0)
        self.seed = QSpinBox()
        self.seed.setRange(0, 2**31 - 1)
        self.backend = QComboBox()
        for key, label in BACKEND_LABELS.items():
            self.backend.addItem(label, key)
        self.backend.setCurrentIndex(max(0, self.backend.findData(default_backend())))
        self.backend.currentIndexChanged.connect(lambda _: self.drop_generator())
        rows = (("Prompt as", "promptKind", self.prompt_kind), ("Max new tokens", "maxNewTokens", self.max_new),
                ("Temperature", "temperatureBox", self.temperature), ("Top-k", "topKBox", self.top_k),
                ("Top-p", "topPBox", self.top_p), ("Seed", "seedBox", self.seed),
                ("Backend", "generateBackend", self.backend))
        form = QFormLayout()
        for label, name, widget in rows:
            widget.setObjectName(name)
            form.addRow(label, widget)
        self.controls = [widget for _, _, widget in rows]
        box = QGroupBox("Sampling")
        box.setLayout(form)
        return box

    def _readouts_box(self) -> QGroupBox:
        rows = (("prompt", "Prompt"), ("tokens", "New tokens"), ("build", "Build"), ("prefill", "Prefill"), ("speed", "Decode"),
                ("median", "Per token"), ("stopped", "Stopped"), ("weights", "Weights"))
        self.readouts = {key: QLabel("–") for key, _ in rows}
        form = QFormLayout()
        for key, label in rows:
            self.readouts[key].setObjectName(f"readout_{key}")
            self.readouts[key].setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            form.addRow(label, self.readouts[key])
        self.readouts["build"].setToolTip(BUILD_TIP)
        box = QGroupBox("This generation")
        box.setLayout(form)
        return box

    def _output_and_plot(self) -> QSplitter:
        self.output = QTextEdit()
        self.output.setObjectName("generateOutput")
        self.output.setReadOnly(True)
        self.output.setPlaceholderText("The prompt and the generated text appear here, token by token.")
        font = self.output.font()
        font.setPointSizeF(font.pointSizeF() * 1.15)
        self.output.setFont(font)
        output = QWidget()
        column = QVBoxLayout(output)
        column.setContentsMargins(0, 0, 0, 0)
        self.output_label = QLabel(OUTPUT_LABEL["text"])
        self.output_label.setWordWrap(True)   # its width is the output's, not a floor for the window's
        column.addWidget(self.output_label)
        column.addWidget(self.output, 1)

        self.plot = pg.PlotWidget(axisItems={"bottom": StepAxis("bottom")})
        self.plot.setObjectName("perTokenPlot")
        self.plot_title = QLabel(PLOT_TITLE)
        self.plot_title.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.plot.setLabel("bottom", "decode step (generated token 2, 3, …; token 1 comes from the prefill)")
        self.plot.setLabel("left", "ms")
        self.plot.showGrid(x=True, y=True, alpha=0.3)
        self.plot.setMouseEnabled(y=False)
        self.curve = self.plot.plot([], [], pen=pg.mkPen(ACCENT, width=1.5), symbol="o", symbolSize=4,
                                    symbolPen=None, symbolBrush=ACCENT)
        self.median_line = pg.InfiniteLine(angle=0, movable=False,
                                           pen=pg.mkPen(MEDIAN, width=1.5, style=Qt.PenStyle.DashLine))
        self.median_line.setVisible(False)
        self.plot.addItem(self.median_line)

        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(output)
        plot = QWidget()
        column = QVBoxLayout(plot)
        column.setContentsMargins(0, 4, 0, 0)
        column.addWidget(self.plot_title)
        column.addWidget(self.plot, 1)
        split.addWidget(plot)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        return split

    # ------------------------------------------------------------ the model

    def generates(self) -> bool:
        model = self.state.model
        return model is not None and bool(getattr(model, "generates", False))

    def _model_changed(self) -> None:
        self.drop_generator()
        self.tokenizer, note = None, ""
        model = self.state.model
        if model is None:
            note = "Open a model to generate text."
        elif not self.generates():
            note = (f"{self.state.model_name} does not generate text: open a causal language model "
                    f"(gpt-tiny, or a Llama-family or GPT-2 checkpoint folder) to use this tab.")
        else:
            try:
                self.tokenizer = model.tokenizer()
                note = self.tokenizer.note or ""
            except MeganeuraError as exc:       # a checkpoint without a tokenizer.json: ids in, ids out
                note = str(exc)
            self.max_new.setMaximum(max(1, int(model.context_length) - 1))
        self.prompt_kind.model().item(0).setEnabled(self.tokenizer is not None)
        self.prompt_kind.setCurrentIndex(self.prompt_kind.findData("text" if self.tokenizer is not None else "ids"))
        self.output_label.setText(OUTPUT_LABEL["ids" if self.generates() and self.tokenizer is None else "text"])
        self.notice.setText(note)
        self.notice.setVisible(bool(note))
        self.notice.setStyleSheet("font-weight: 600;" if not self.generates() else "")
        self._update_controls()

    def drop_generator(self) -> None:
        """Forget the compiled generator; the next Generate builds one for the model and
        weights open then (a running generation keeps its own)."""
        self.generator = None

    def backend_name(self) -> str:
        return str(self.backend.currentData())

    def ensure_generator(self):
        if self.generator is None:
            self.generator = self.state.model.generator(self.state.params, backend=self.backend_name())
        return self.generator

    # ------------------------------------------------------------ the request

    def prompt_request(self) -> list[int]:
        """The prompt's token ids, from the text (through the tokenizer) or typed as ids."""
        text = self.prompt.toPlainText()
        if not text or (self.prompt_kind.currentData() == "ids" and not text.strip()):
            raise MeganeuraError("the prompt is empty: type some text (or token ids) for the model to continue")
        if self.prompt_kind.currentData() == "ids":
            return parse_prompt_ids(text)
        return list(self.tokenizer.encode(text))

    def sampling(self) -> Sampling:
        return Sampling(self.temperature.value(), self.top_k.value(), self.top_p.value(), self.seed.value())

    # ------------------------------------------------------------ the run

    def running(self) -> bool:
        return self.worker is not None

    def toggle(self) -> None:
        if self.worker is None:
            self.generate()
        else:
            self.stop()

    def stop(self) -> None:
        if self.worker is not None:
            self._stop.set()
            self.button.setText("Stopping…")
            self.button.setEnabled(False)

    def generate(self):
        """Start a generation in a worker; bad requests are an error dialog and start nothing."""
        if self.worker is not None or not self.generates():
            return None
        if not self.can_run():
            self.failed.emit("Cannot generate", MeganeuraError("the GPU is busy with a training run or a profile: "
                                                               "wait for it or stop it"))
            return None
        try:
            prompt = self.prompt_request()
            sampling = self.sampling()
            generator = self.ensure_generator()
            generator.check(prompt, self.max_new.value())     # empty, too long, ids outside the vocabulary
        except Exception as exc:
            self.failed.emit("Cannot generate", exc)
            return None
        self._begin(prompt)
        self.batched = generator.runs_ahead(sampling)
        worker = generation_run(generator, prompt, self.max_new.value(), sampling, self.state.model.eos_ids(),
                                self.arrived, self._stop, _start_thread=False, _ignore_errors=True)
        worker.returned.connect(self._on_result)
        worker.errored.connect(self._on_error)
        worker.finished.connect(self._on_finished)
        self.worker = worker
        self.redraw_timer.start()
        self._update_controls()
        worker.start()
        return worker

    def _begin(self, prompt: list[int]) -> None:
        """Clear the last generation's output, read-outs and plot; show the prompt."""
        from engine.data.tokenizer import TextStream
        self.prompt_ids, self.max_new_tokens = prompt, self.max_new.value()
        self.arrived, self.shown, self.result = [], 0, None
        self._stop = threading.Event()
        self._end_reason = "failed"
        self.stream = TextStream(self.tokenizer) if self.tokenizer is not None else None
        self.generated_text = ""
        self.output.clear()
        self.shown_prompt = self.prompt_display(prompt)
        self._append(self.shown_prompt, generated=False)
        self.curve.setData([], [])
        self.median_line.setVisible(False)
        self.plot_title.setText(PLOT_TITLE)
        for label in self.readouts.values():
            label.setText("–")
        self.readouts["prompt"].setText(f"{len(prompt)} tokens")
        self.readouts["tokens"].setText(f"0 / {self.max_new_tokens}")
        self.readouts["build"].setText("…")
        self.readouts["prefill"].setText("running…")
        self.readouts["stopped"].setText("generating…")

    def prompt_display(self, prompt: list[int]) -> str:
        if self.prompt_kind.currentData() == "text":
            return self.prompt.toPlainText()
        text = self.tokenizer.decode(prompt) if self.tokenizer is not None else ""
        return text or " ".join(map(str, prompt)) + " "

    def _append(self, text: str, generated: bool) -> None:
        if not text:
            return
        bar = self.output.verticalScrollBar()
        at_end = bar.value() >= bar.maximum() - 4
        fmt = QTextCharFormat()                 # the prompt: the widget's own text colour
        fmt.setFontWeight(QFont.Weight.Bold if generated else QFont.Weight.Normal)
        if generated:
            fmt.setForeground(self.palette().color(self.palette().ColorRole.Link))
        cursor = QTextCursor(self.output.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(text, fmt)
        if at_end:
            bar.setValue(bar.maximum())

    def changeEvent(self, event) -> None:
        """A new colour scheme: draw the output again in its colours."""
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange and self.output.document().characterCount() > 1:
            self.output.clear()
            self._append(self.shown_prompt, generated=False)
            self._append(self.generated_text, generated=True)

    def _take_new_tokens(self) -> None:
        """Show the tokens the worker produced since the last call."""
        new = self.arrived[self.shown:]
        self.shown += len(new)
        for token, _ in new:
            piece = self.stream.push(token) if self.stream is not None else f"{token} "
            self.generated_text += piece
            self._append(piece, generated=True)

    def redraw(self) -> None:
        shown = self.shown
        self._take_new_tokens()
        if self.shown == shown and self.result is None:
            return
        times = [ms for _, ms in self.arrived[:self.shown]]
        decode = times[1:]
        self.readouts["tokens"].setText(f"{self.shown} / {self.max_new_tokens}")
        if times:
            self.readouts["prefill"].setText(f"{times[0]:,.1f} ms")
        if decode:
            self.plot_times(decode)
            self.readouts["speed"].setText(f"{1000.0 * len(decode) / sum(decode):,.1f} tokens/s")
            self.readouts["median"].setText(f"{statistics.median(decode):,.2f} ms median")

    def plot_times(self, decode: list[float]) -> None:
        """Each decode step's ms from 0 up (so small wobbles look small), and the median."""
        self.curve.setData(np.arange(1, len(decode) + 1, dtype=float), np.asarray(decode, dtype=float))
        median = statistics.median(decode)
        self.median_line.setValue(median)
        self.median_line.setVisible(True)
        batched = f" · greedy on the GPU: each point is its batch of {GREEDY_BATCH}'s ms a token" \
            if self.batched else ""
        self.plot_title.setText(f"{PLOT_TITLE} · <span style='color:{MEDIAN}'>- - - median {median:,.2f} ms</span>"
                                f"{batched}")
        self.plot.setXRange(0.5, max(len(decode), 2) + 0.5, padding=0.02)
        self.plot.setYRange(0, 1.1 * max(decode), padding=0)

    def _on_result(self, result) -> None:
        self.result = result
        self._end_reason = result.stopped

    def _on_error(self, exc) -> None:
        self._end_reason = "failed"
        self.failed.emit("Generation failed", exc)

    def _on_finished(self) -> None:
        self.worker = None
        self.redraw_timer.stop()
        self.redraw()
        result = self.result
        if result is not None:
            if self.stream is not None:
                piece = self.stream.flush()
                self.generated_text += piece
                self._append(piece, generated=True)
            self.readouts["build"].setText(build_text(result.build_seconds))
            self.readouts["prefill"].setText(f"{1000 * result.prefill_seconds:,.1f} ms")
            rate = result.decode_tokens_per_second
            self.readouts["speed"].setText(f"{rate:,.1f} tokens/s" if rate else "– (one token: prefill only)")
            kept = len(self.generator.bf16_weights()) if self.generator is not None else 0
            self.readouts["weights"].setText(f"{kept} in bf16, as stored" if kept else "f32")
            self.readouts["weights"].setToolTip(WEIGHTS_TIP if kept else "")
        self.readouts["stopped"].setText(STOP_REASONS.get(self._end_reason, self._end_reason))
        self._update_controls()
        self.generationFinished.emit(self._end_reason)

    # ------------------------------------------------------------ enabling

    def _update_controls(self) -> None:
        running = self.worker is not None
        able = self.generates()
        for w in self.controls:
            w.setEnabled(able and not running)
        sampled = self.temperature.value() > 0
        for w in (self.top_k, self.top_p, self.seed):
            w.setEnabled(able and not running and sampled)
        self.prompt.setEnabled(able)            # editable while running: the run has its own copy
        self.button.setEnabled(able and not (running and self._stop.is_set()))
        self.button.setText("Stop" if running else "Generate")

    def plotted_points(self) -> int:
        x, _ = self.curve.getData()
        return 0 if x is None else len(x)
