"""Inputs a user gives a model are checked before either backend runs: every name against
the model's inputs (and given once), every integer against int32, every id against the
table it indexes. Without the checks the reference raised a bare IndexError, the GPU read
zeros past a table's end, 2**40 wrapped to row 0 and a misspelt name was dropped."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from engine import models
from engine.cli import main
from engine.errors import InputError
from engine.graph import reference
from engine.graph.inputs import IndexRange, index_ranges
from engine.importers import load_model
from test_onnx_import import _save

ROWS = 10
IDS = 8                                  # ids each input holds
TABLE = np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 4)
BACKENDS = ("reference", "gpu")


@pytest.fixture
def gather_onnx(tmp_path):
    """Two int64 inputs, each a Gather from one 10-row initializer table."""
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["y"], name="lookup"),
             helper.make_node("Gather", ["emb", "more_ids"], ["z"], name="lookup2")]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, [IDS]) for n in ("ids", "more_ids")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [IDS, 4]) for n in ("y", "z")]
    return _save(tmp_path, nodes, inputs, outputs, name="gather.onnx",
                 initializers=[onnx.numpy_helper.from_array(TABLE, "emb")])


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def ids_of(*values) -> np.ndarray:
    """``values`` then zeros, IDS in all, as int64 (ONNX's index type)."""
    return np.array(list(values) + [0] * (IDS - len(values)), np.int64)


def npy(tmp_path, name, values, dtype=np.int64):
    path = tmp_path / f"{name}.npy"
    np.save(path, np.asarray(values, dtype))
    return path


def one_error_line(code, out, err):
    lines = [line for line in err.strip().splitlines() if line.startswith("meganeura:")]
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("meganeura: error: "), err
    assert "Traceback" not in err
    return lines[0]


# ------------------------------------------------------------------ names

@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_input_names_are_refused_together_with_the_models_inputs(tmp_path, capsys, backend):
    x = npy(tmp_path, "x", np.zeros((32, 784)), np.float32)
    line = one_error_line(*cli(capsys, "run", "mlp", "--input", f"nosuch={x}", "--input", f"other={x}",
                               "--backend", backend))
    assert "'nosuch', 'other'" in line and "its inputs are x" in line


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_case_typo_in_an_onnx_input_name_is_refused_with_a_hint(tmp_path, capsys, gather_onnx, backend):
    ids = npy(tmp_path, "ids", ids_of(1, 2))
    line = one_error_line(*cli(capsys, "run", gather_onnx, "--input", f"IDS={ids}", "--backend", backend))
    assert "'IDS'" in line and "its inputs are ids, more_ids" in line and "'IDS' -> 'ids'" in line


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_input_given_twice_is_refused(tmp_path, capsys, backend):
    x = npy(tmp_path, "x", np.zeros((32, 784)), np.float32)
    line = one_error_line(*cli(capsys, "run", "mlp", "--input", f"x={x}", "--input", f"x={x}",
                               "--backend", backend))
    assert "more than once for 'x'" in line


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_engine_refuses_a_value_for_an_input_the_model_has_not(backend):
    model = models.create("mlp", ["batch=2"])
    inputs = {**model.example_inputs(), "nosuch": np.zeros(3, np.float32)}
    with pytest.raises(InputError, match="no input.*'nosuch'.*its inputs are x"):
        model.run(inputs, backend=backend)


# ------------------------------------------------------------------ integer ids

BAD_IDS = [
    ("past the table", [3, 12], "input 'ids' holds 12, outside [-10, 10)"),
    ("below -rows", [-11, 0], "input 'ids' holds -11, outside [-10, 10)"),
    ("beyond int32", [3, 2**40], "input 'ids' holds 1099511627776, beyond the int32 range"),
    ("first few", list(range(10, 17)), "input 'ids' holds 10, 11, 12, 13, 14 and 2 more, outside"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case, ids, message", BAD_IDS, ids=[c[0] for c in BAD_IDS])
def test_bad_ids_are_one_line_and_exit_2(tmp_path, capsys, gather_onnx, backend, case, ids, message):
    given, more = npy(tmp_path, "given", ids_of(*ids)), npy(tmp_path, "more", ids_of(1, 2))
    line = one_error_line(*cli(capsys, "run", gather_onnx, "--input", f"ids={given}", "--input", f"more_ids={more}",
                               "--backend", backend))
    assert message in line


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case, ids, message", BAD_IDS, ids=[c[0] for c in BAD_IDS])
def test_the_engine_refuses_bad_ids_on_both_backends(gather_onnx, backend, case, ids, message):
    model = load_model(gather_onnx)
    with pytest.raises(InputError) as e:
        model.run({"ids": ids_of(*ids), "more_ids": ids_of(1, 2)}, backend=backend)
    assert message in str(e.value)


def test_every_offending_input_is_named_at_once(gather_onnx):
    model = load_model(gather_onnx)
    with pytest.raises(InputError) as e:
        model.run({"ids": ids_of(3, 12), "more_ids": ids_of(2**33)}, backend="reference")
    assert "input 'ids' holds 12" in str(e.value) and "input 'more_ids' holds 8589934592" in str(e.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_ids_count_from_the_end_as_onnx_gather_says(gather_onnx, backend):
    model = load_model(gather_onnx)
    ids, more = ids_of(-1, -10, 3), ids_of(9, -3)
    got = model.run({"ids": ids, "more_ids": more}, backend=backend)
    np.testing.assert_array_equal(got["y"], TABLE[ids])      # numpy counts negative ids from the end too
    np.testing.assert_array_equal(got["z"], TABLE[more])


def test_index_ranges_follow_onnx_gathers_through_index_wrap(gather_onnx):
    graph = load_model(gather_onnx).build(train=False)
    assert index_ranges(graph) == {"ids": IndexRange(-ROWS, ROWS), "more_ids": IndexRange(-ROWS, ROWS)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_builtin_models_token_ids_are_checked_against_its_embedding(backend):
    model = models.create("gpt-tiny", ["batch=1", "seq=8"])
    tokens = model.example_inputs()["tokens"].astype(np.int64)
    vocab = model.vocab_size
    tokens[0, 3] = vocab
    with pytest.raises(InputError, match=rf"input 'tokens' holds {vocab}, outside \[0, {vocab}\)"):
        model.run({"tokens": tokens}, backend=backend)


def test_the_reference_refuses_integers_beyond_int32_given_directly(gather_onnx):
    model = load_model(gather_onnx)
    graph = model.build(train=False)
    with pytest.raises(InputError, match="input 'ids' holds 4294967296, beyond the int32 range"):
        reference.run(graph, {"ids": ids_of(2**32), "more_ids": ids_of(1)}, model.init_params())
