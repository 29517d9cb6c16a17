"""ONNX's own node conformance suite through the importer on the reference backend:
every case either matches ONNX's expected outputs or is refused with a MeganeuraError."""

import warnings

import numpy as np
import onnx
import pytest

from engine.errors import MeganeuraError
from engine.importers.onnx import load_onnx


def test_onnx_node_conformance_suite(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from onnx.backend.test.case.node import collect_testcases
        cases = collect_testcases()
    assert len(cases) > 1000
    passed, refused, wrong = [], [], []
    for case in cases:
        path = tmp_path / f"{case.name}.onnx"
        onnx.save(case.model, path)
        graph = case.model.graph
        init = {t.name for t in graph.initializer}
        names = [i.name for i in graph.input if i.name not in init]
        try:
            model = load_onnx(path, {})
            for inputs, expected in case.data_sets:
                got = model.run(dict(zip(names, inputs)), backend="reference")
                for out, want in zip(graph.output, expected):
                    want = np.asarray(want)
                    assert got[out.name].shape == want.shape, (case.name, out.name)
                    try:
                        np.testing.assert_allclose(got[out.name].astype(np.float64), want.astype(np.float64),
                                                   rtol=1e-4, atol=1e-5)
                    except AssertionError as e:
                        wrong.append(f"{case.name}/{out.name}: {str(e)[:300]}")
        except MeganeuraError:
            refused.append(case.name)
            continue
        passed.append(case.name)
    print(f"\nONNX conformance: {len(passed)} passed, {len(refused)} refused, {len(wrong)} wrong "
          f"of {len(cases)} cases")
    assert not wrong, "\n".join(wrong)
    assert len(passed) >= 300
    # a few cases that must load and pass (the importer's core ops)
    for name in ("test_gemm_all_attributes", "test_conv_with_strides_padding", "test_layer_normalization_4d_axis1",
                 "test_softmax_axis_0", "test_batchnorm_epsilon",
                 "test_maxpool_2d_pads", "test_averagepool_2d_pads", "test_gather_1"):
        assert name in passed, name
