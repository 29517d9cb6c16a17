"""The Studio's Generate tab, driven with pytest-qt on gpt-tiny (random weights, the
reference backend to keep it fast; the engine's own generation tests cover the GPU)."""

import pytest
from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QFont, QTextCursor

from app.generate_panel import build_text
from app.window import MainWindow
from engine.train.generation import Sampling

GPT = {"seq": 16, "batch": 2}


@pytest.fixture
def window(qtbot, tmp_path, errors):
    w = MainWindow("gpt-tiny", settings=QSettings(str(tmp_path / "studio.ini"), QSettings.Format.IniFormat),
                   model_settings=GPT)
    qtbot.addWidget(w)
    w.show()
    w.wait_for_workers(60)                      # the optimizer's worker: leave the CPU to the generation
    panel = w.generate_panel
    panel.backend.setCurrentIndex(panel.backend.findData("reference"))
    w.tabs.setCurrentWidget(panel)
    yield w
    w.wait_for_workers(30)
    assert panel.worker is None


def generate(qtbot, panel, prompt: str, new_tokens: int, timeout=30000) -> str:
    panel.prompt.setPlainText(prompt)
    panel.max_new.setValue(new_tokens)
    with qtbot.waitSignal(panel.generationFinished, timeout=timeout) as finished:
        qtbot.mouseClick(panel.button, Qt.MouseButton.LeftButton)
    return finished.args[0]


def weight_at(panel, position: int) -> QFont.Weight:
    cursor = QTextCursor(panel.output.document())
    cursor.setPosition(position)
    return cursor.charFormat().fontWeight()


def test_greedy_text_streams_as_the_engine_generates_it(window, qtbot, errors):
    panel, state = window.generate_panel, window.state
    assert window.tabs.tabText(window.tabs.indexOf(panel)) == "Generate"
    assert panel.button.isEnabled() and panel.notice.isHidden()
    prompt = "the cat "
    assert generate(qtbot, panel, prompt, 8) == "length"

    tokenizer = state.model.tokenizer()
    expected = state.model.generator(state.params, backend="reference").generate(
        tokenizer.encode(prompt), 8, Sampling(), state.model.eos_ids())
    assert panel.result.tokens == expected.tokens and panel.result.stopped == "length"
    assert panel.generated_text == tokenizer.decode(expected.tokens)
    shown = panel.output.toPlainText()
    assert shown.startswith(prompt) and len(shown) == len(prompt) + len(panel.generated_text)
    # the prompt in the normal weight, the new text bold
    assert weight_at(panel, 1) == QFont.Weight.Normal and weight_at(panel, len(shown)) == QFont.Weight.Bold
    # one point per decode step, at the generator's timings
    assert panel.plotted_points() == len(expected.per_token_ms) == 7
    _, y = panel.curve.getData()
    assert list(y) == pytest.approx(panel.result.per_token_ms)
    text = {key: label.text() for key, label in panel.readouts.items()}
    assert text["prompt"] == f"{len(tokenizer.encode(prompt))} tokens"
    assert text["tokens"] == "8 / 8"
    assert text["build"] == build_text(panel.result.build_seconds) and panel.result.build_seconds > 0
    assert text["prefill"] == f"{1000 * panel.result.prefill_seconds:,.1f} ms"
    assert text["speed"] == f"{panel.result.decode_tokens_per_second:,.1f} tokens/s"
    assert text["median"].endswith("ms median") and text["stopped"] == "reached max new tokens"
    assert text["weights"] == "f32"
    assert panel.button.text() == "Generate" and panel.button.isEnabled() and not errors

    # the compiled generator is kept for the next run, and dropped when the weights change
    generator = panel.generator
    panel.prompt_kind.setCurrentIndex(panel.prompt_kind.findData("ids"))
    assert generate(qtbot, panel, ", ".join(map(str, tokenizer.encode(prompt))), 3) == "length"
    assert panel.generator is generator and panel.result.tokens == expected.tokens[:3]
    assert panel.result.build_seconds == 0 and panel.readouts["build"].text() == "kept from the last generation"
    state.set_params(state.model.init_params(seed=1))
    assert panel.generator is None


def test_greedy_on_the_gpu_says_its_points_are_batches(window, qtbot, errors):
    """On the GPU greedy decoding runs ahead: the same ids as the reference, each point its
    batch's ms a token, which the plot's title says; sampled runs plot single steps."""
    panel, state = window.generate_panel, window.state
    panel.backend.setCurrentIndex(panel.backend.findData("gpu"))
    assert generate(qtbot, panel, "the dog ", 12, timeout=120000) == "length"
    tokenizer = state.model.tokenizer()
    expected = state.model.generator(state.params, backend="reference").generate(
        tokenizer.encode("the dog "), 12, Sampling(), state.model.eos_ids())
    assert panel.result.tokens == expected.tokens and panel.batched
    assert "greedy on the GPU" in panel.plot_title.text() and panel.plotted_points() == 11
    panel.temperature.setValue(0.8)
    assert generate(qtbot, panel, "the dog ", 4, timeout=120000) == "length"
    assert not panel.batched and "greedy" not in panel.plot_title.text() and not errors


def test_a_bf16_checkpoint_says_its_weights_stay_bf16(window, qtbot, errors, tmp_path):
    """A checkpoint stored in bf16, generated from on the GPU: the read-out counts the weights
    kept in bf16 (engine.optimize.bf16_weights), the ids those of the reference."""
    import torch
    from llama_checkpoint import llama_relative
    llama_relative("Llama", 2).to(torch.bfloat16).save_pretrained(tmp_path)
    assert window.load_model(str(tmp_path), {})
    panel, state = window.generate_panel, window.state
    panel.backend.setCurrentIndex(panel.backend.findData("gpu"))
    panel.prompt_kind.setCurrentIndex(panel.prompt_kind.findData("ids"))
    assert generate(qtbot, panel, "3, 17, 9", 4, timeout=120000) == "length"
    matrices = sum(value.ndim == 2 for value in state.params.values())
    assert panel.readouts["weights"].text() == f"{matrices} in bf16, as stored"
    assert "bit for bit" in panel.readouts["weights"].toolTip()
    expected = state.model.generator(state.params, backend="reference").generate([3, 17, 9], 4, Sampling())
    assert panel.result.tokens == expected.tokens and not errors


def test_a_checkpoint_without_a_tokenizer_shows_its_ids(window, qtbot, errors, tmp_path):
    """A checkpoint folder without a tokenizer.json (a vocabulary over the 256 bytes): the
    prompt is ids only, and the new tokens show as ids, not as an empty text."""
    from llama_checkpoint import save_llama
    panel = window.generate_panel
    assert "generated text in bold" in panel.output_label.text()     # gpt-tiny's bytes
    assert window.load_model(save_llama(tmp_path, vocab_size=512), {})
    panel.backend.setCurrentIndex(panel.backend.findData("reference"))
    assert "no tokenizer.json" in panel.notice.text() and not panel.notice.isHidden()
    assert panel.prompt_kind.currentData() == "ids" and not panel.prompt_kind.model().item(0).isEnabled()
    assert "generated ids in bold" in panel.output_label.text()
    assert generate(qtbot, panel, "3, 17, 9", 4) == "length"
    ids = " ".join(map(str, panel.result.tokens)) + " "
    assert panel.generated_text == ids and panel.output.toPlainText() == "3 17 9 " + ids and not errors


def test_stop_cancels_a_long_generation(window, qtbot, errors):
    panel = window.generate_panel
    panel.prompt.setPlainText("a dog ")
    panel.max_new.setValue(400)
    qtbot.mouseClick(panel.button, Qt.MouseButton.LeftButton)
    assert panel.running() and panel.button.text() == "Stop"
    assert not panel.max_new.isEnabled()
    # one job on the GPU at a time: training and profiling say it is busy; the model stays
    assert window.training_panel.start() is None and window.profiler_panel.run() is None
    assert not window.load_model("mlp", {"batch": 4}) and window.state.model_name == "gpt-tiny"
    assert [title for title, _ in errors] == ["Cannot start training", "Cannot profile", "Cannot load a model"]
    qtbot.waitUntil(lambda: panel.plotted_points() >= 2, timeout=30000)     # streaming, plot live
    with qtbot.waitSignal(panel.generationFinished, timeout=30000) as finished:
        qtbot.mouseClick(panel.button, Qt.MouseButton.LeftButton)
    assert finished.args == ["cancelled"] and panel.result.stopped == "cancelled"
    assert 3 <= len(panel.result.tokens) < 400
    assert panel.readouts["stopped"].text() == "stopped by you"
    assert panel.readouts["tokens"].text() == f"{len(panel.result.tokens)} / 400"
    assert panel.button.text() == "Generate" and panel.button.isEnabled() and panel.max_new.isEnabled()


def test_a_model_that_does_not_generate_disables_the_tab(window, qtbot):
    panel = window.generate_panel
    assert window.load_model("mlp", {"batch": 4})
    assert not panel.notice.isHidden()
    assert panel.notice.text().startswith("mlp does not generate text")
    assert not panel.button.isEnabled() and not panel.prompt.isEnabled() and not panel.max_new.isEnabled()
    assert panel.generate() is None and panel.worker is None
    window.wait_for_workers(60)
    assert window.load_model("gpt-tiny", GPT)
    assert panel.notice.isHidden() and panel.button.isEnabled() and panel.generator is None


def test_bad_prompts_are_dialogs_and_nothing_is_lost(window, qtbot, errors):
    panel = window.generate_panel
    assert generate(qtbot, panel, "the moon", 2) == "length"
    before = panel.output.toPlainText()
    too_long = "x" * 4096                        # BOS + 4,096 bytes + 2 new tokens > the context of 4,096
    for kind, prompt, words in (("text", too_long, "over the model's context length of 4096"),
                                ("text", "", "the prompt is empty"),
                                ("ids", "12, 300", "outside the vocabulary of 257"),
                                ("ids", "12, x", "is not token ids")):
        panel.prompt_kind.setCurrentIndex(panel.prompt_kind.findData(kind))
        panel.prompt.setPlainText(prompt)
        assert panel.generate() is None and panel.worker is None
        title, text = errors[-1]
        assert title == "Cannot generate" and words in text, text
        assert panel.prompt.toPlainText() == prompt and panel.output.toPlainText() == before
    assert len(errors) == 4 and len(window.errors) == 4
    assert panel.button.isEnabled() and panel.button.text() == "Generate"
    panel.prompt_kind.setCurrentIndex(panel.prompt_kind.findData("text"))
    panel.prompt.setPlainText("my sister")                           # the window keeps working
    window.activateWindow()
    panel.prompt.setFocus()
    with qtbot.waitSignal(panel.generationFinished, timeout=30000):
        qtbot.keyClick(panel.prompt, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    assert panel.output.toPlainText().startswith("my sister") and panel.prompt.toPlainText() == "my sister"


def test_the_step_plots_tick_whole_steps(window, qtbot):
    """Over three steps pyqtgraph ticked 0.5, 1.5...: a step is a whole number (the decode
    plot and the training loss's)."""
    for plot in (window.generate_panel.plot, window.training_panel.plot):
        axis = plot.getAxis("bottom")
        for low, high in ((1, 3), (1, 2.2), (1, 40)):
            levels = axis.tickValues(low, high, 600)
            assert levels and all(float(v).is_integer() for _, values in levels for v in values), levels
