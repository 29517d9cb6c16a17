import json
import os
import struct

import numpy as np
import pytest

from engine.errors import WeightsError
from engine.weights import WeightsMismatchError, bind_weights, load_safetensors, save_safetensors

import torch
from safetensors.torch import save_file


def _tensors():
    rng = np.random.default_rng(0)
    return {
        "layer.weight": rng.standard_normal((3, 5)).astype(np.float32),
        "layer.bias": rng.standard_normal(5).astype(np.float32),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "ids": np.arange(6, dtype=np.int32).reshape(2, 3),
    }


def test_round_trip_f32(tmp_path):
    path = tmp_path / "w.safetensors"
    tensors = _tensors()
    save_safetensors(tensors, path, metadata={"model": "mlp"})
    loaded = load_safetensors(path)
    assert set(loaded) == set(tensors)
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype
        assert loaded[name].shape == value.shape
        np.testing.assert_array_equal(loaded[name], value)
        assert loaded[name].flags.c_contiguous


def test_save_converts_float64_and_int64(tmp_path):
    path = tmp_path / "w.safetensors"
    save_safetensors({"a": np.ones((2, 2)), "b": np.arange(3)}, path)
    loaded = load_safetensors(path)
    assert loaded["a"].dtype == np.float32 and loaded["b"].dtype == np.int32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_half_and_bf16_load_as_f32(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    src = {
        "a": (torch.randn(4, 7, generator=g) * 100).to(dtype),
        "b": torch.tensor([0.0, -0.0, 1e-8, 65504.0, float("inf"), -float("inf")]).to(dtype),
    }
    path = tmp_path / "h.safetensors"
    save_file(src, str(path))
    loaded = load_safetensors(path)
    for name, t in src.items():
        assert loaded[name].dtype == np.float32
        np.testing.assert_array_equal(loaded[name], t.to(torch.float32).numpy())


def test_int64_loads_as_int32(tmp_path):
    path = tmp_path / "i.safetensors"
    save_file({"t": torch.arange(10, dtype=torch.int64).reshape(2, 5)}, str(path))
    loaded = load_safetensors(path)
    assert loaded["t"].dtype == np.int32
    np.testing.assert_array_equal(loaded["t"], np.arange(10).reshape(2, 5))


def _good_file(tmp_path):
    path = tmp_path / "good.safetensors"
    save_safetensors(_tensors(), path)
    return path.read_bytes()


def _assert_weights_error(path, *words):
    with pytest.raises(WeightsError) as info:
        load_safetensors(path)
    message = str(info.value)
    assert str(path) in message
    for word in words:
        assert word in message, message
    return message


def test_truncated_at_many_positions(tmp_path):
    blob = _good_file(tmp_path)
    (header_len,) = struct.unpack("<Q", blob[:8])
    cuts = [0, 1, 4, 7, 8, 9, 8 + header_len // 2, 8 + header_len, 8 + header_len + 1, len(blob) - 1]
    for cut in cuts:
        path = tmp_path / f"cut{cut}.safetensors"
        path.write_bytes(blob[:cut])
        _assert_weights_error(path)


def test_truncated_data_message(tmp_path):
    blob = _good_file(tmp_path)
    path = tmp_path / "short.safetensors"
    path.write_bytes(blob[:-10])
    (header_len,) = struct.unpack("<Q", blob[:8])
    data_len = len(blob) - 8 - header_len
    _assert_weights_error(path, "truncated", f"{data_len} bytes of data", f"file has {data_len - 10}")


def test_corrupt_json_header(tmp_path):
    blob = bytearray(_good_file(tmp_path))
    blob[8] = ord("[")  # '{' -> '[' : invalid JSON
    blob[9:12] = b"@@@"
    path = tmp_path / "json.safetensors"
    path.write_bytes(bytes(blob))
    _assert_weights_error(path, "JSON")


def _file_with_header(tmp_path, header, data=b""):
    raw = json.dumps(header).encode()
    path = tmp_path / "custom.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_header_problems(tmp_path):
    cases = [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8, "needs 8 bytes"),
        ({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "Q7"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "shape"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, "data_offsets"),
        ({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, "data_offsets"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "truncated"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "overlap",
        ),
        ({"a": [1, 2]}, b"", "tensor 'a'"),
        ([1, 2, 3], b"", "not an object"),
        ({"__metadata__": [1]}, b"", "__metadata__"),
    ]
    for header, data, word in cases:
        _assert_weights_error(_file_with_header(tmp_path, header, data), word)


def test_random_bytes_empty_npz_text(tmp_path):
    rng = np.random.default_rng(3)
    for i in range(20):
        path = tmp_path / f"random{i}.safetensors"
        path.write_bytes(rng.integers(0, 256, size=int(rng.integers(1, 4000)), dtype=np.uint8).tobytes())
        _assert_weights_error(path)

    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    _assert_weights_error(empty, "empty")

    npz = tmp_path / "weights.npz"
    np.savez(npz, a=np.ones(3))
    renamed = tmp_path / "renamed.safetensors"
    os.rename(npz, renamed)
    _assert_weights_error(renamed, "not a safetensors file", "zip")

    text = tmp_path / "notes.safetensors"
    text.write_text("these are not weights, just some words in a text file\n" * 3)
    _assert_weights_error(text, "not a safetensors file")

    _assert_weights_error(tmp_path / "missing.safetensors", "no such file")
    _assert_weights_error(tmp_path, "directory")


def test_bind_reports_every_problem():
    tensors = {
        "c.d": np.zeros((1536, 385), np.float32),
        "ok": np.ones(3, np.float32),
        "extra.thing": np.zeros(2, np.float32),
    }
    expected = {"a.b": (384,), "c.d": (384, 1536), "ok": (3,), "e.f": (2, 3, 4)}
    before = {k: v.copy() for k, v in tensors.items()}
    with pytest.raises(WeightsMismatchError) as info:
        bind_weights(tensors, expected, transposes={"c.d": True, "e.f": (2, 0, 1)}, source="x.safetensors")
    message = str(info.value)
    assert message.startswith("weights file x.safetensors does not fit")
    assert "2 missing: a.b (expected [384]), e.f (expected [3, 4, 2])" in message   # as the file stores them
    assert "1 mis-shaped: c.d expected [1536, 384] found [1536, 385]" in message
    assert "1 unexpected: extra.thing [2]" in message
    assert info.value.missing == [("a.b", (384,)), ("e.f", (2, 3, 4))]
    assert info.value.unexpected == [("extra.thing", (2,))]
    assert info.value.misshaped == [("c.d", (384, 1536), (385, 1536))]
    for name, value in before.items():  # nothing was modified
        np.testing.assert_array_equal(tensors[name], value)
        assert tensors[name].shape == value.shape


def test_bind_transposes_and_converts():
    w = np.arange(6, dtype=np.float64).reshape(2, 3)  # stored [out=2, in=3]
    b = np.array([1, 2], dtype=np.int32)
    out = bind_weights({"fc.weight": w, "fc.bias": b}, {"fc.weight": (3, 2), "fc.bias": [2]}, ["fc.weight"])
    assert out["fc.weight"].shape == (3, 2)
    assert out["fc.weight"].dtype == np.float32 and out["fc.weight"].flags.c_contiguous
    np.testing.assert_array_equal(out["fc.weight"], w.T)
    assert out["fc.bias"].dtype == np.float32
    assert w.shape == (2, 3)  # caller's array untouched

    x = np.zeros((2, 3, 4), np.float32)
    out = bind_weights({"x": x}, {"x": (4, 2, 3)}, transposes={"x": (2, 0, 1)})
    assert out["x"].shape == (4, 2, 3)


def test_bind_owned_tensors_without_copies():
    """Tensors just read from a file are bound as they are: float32 ones themselves, the
    transposed ones as views; the caller's tensors otherwise as contiguous copies."""
    w = np.arange(6, dtype=np.float32).reshape(2, 3)   # stored [out=2, in=3]
    b = np.array([1, 2], dtype=np.float32)
    ids = np.array([4, 5], dtype=np.int32)
    expected = {"fc.weight": (3, 2), "fc.bias": [2], "ids": [2]}
    out = bind_weights({"fc.weight": w, "fc.bias": b, "ids": ids}, expected, ["fc.weight"], owned=True)
    assert out["fc.bias"] is b and np.shares_memory(out["fc.weight"], w) and np.array_equal(out["fc.weight"], w.T)
    assert out["ids"].dtype == np.float32 and np.array_equal(out["ids"], ids)
    copied = bind_weights({"fc.weight": w, "fc.bias": b, "ids": ids}, expected, ["fc.weight"])
    assert not any(np.shares_memory(copied[k], v) for k, v in (("fc.weight", w), ("fc.bias", b)))
    assert copied["fc.weight"].flags.c_contiguous


def test_bind_allow_missing():
    out = bind_weights({"a": np.ones(2)}, {"a": (2,), "b": (3,)}, allow_missing=True)
    assert set(out) == {"a"}
    with pytest.raises(WeightsError, match="1 missing: b"):
        bind_weights({"a": np.ones(2)}, {"a": (2,), "b": (3,)})


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    save_safetensors({"a": np.ones(3, np.float32)}, path)
    original = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(WeightsError, match="No space left"):
        save_safetensors({"a": np.zeros(1000, np.float32)}, path)
    assert path.read_bytes() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def test_save_rejects_bad_tensors(tmp_path):
    with pytest.raises(WeightsError):
        save_safetensors({"a": np.array(["x"])}, tmp_path / "s.safetensors")
    assert not list(tmp_path.iterdir())


def test_bind_keeps_scalars_and_copies():
    s = np.array(3.0, np.float32)
    out = bind_weights({"s": s}, {"s": ()})
    assert out["s"].shape == ()
    out["s"][...] = 7
    assert s == 3.0
