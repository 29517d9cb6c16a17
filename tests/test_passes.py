"""The passes after the fusion rules (engine.optimize.passes) keep the fusion report true:
its totals, node ids and origins describe the graph that runs, and each pass has a row."""

import copy
from collections import Counter

from engine import models
from engine.autodiff.gradients import differentiate
from engine.optimize import cost, optimize
from engine.optimize.passes import TRAINING, optimize_inference, run_passes
from engine.optimize.report import OptimizeReport
from engine.optimize.stacked_products import stack_products


def whisper_training_graph():
    """whisper-tiny's differentiated graph (what the training report's origins name) and
    the rules' result on it with its report."""
    fused, _ = optimize(models.create("whisper-tiny", ["mel_len=64", "batch=8"]).build(train=True))
    train, _ = differentiate(fused)
    return (train,) + optimize(train)


def test_the_report_describes_the_graph_after_the_passes():
    train, base, report = whisper_training_graph()
    out, counts = run_passes(base, TRAINING, report)
    assert report.passes == counts == {"attention_stats": 4, "preactivation": 4, "norm_residual": 8,
                                       "stacked_products": 44, "activation_grad": 4, "outputs_early": 97}
    assert report.nodes_after == len(out)
    assert (report.bytes_after, report.dispatches_after) == cost.graph_cost(out)
    assert report.dispatches_after < cost.graph_cost(base)[1]
    assert set(report.origins) <= {n.id for n in out.nodes}
    assert all(set(srcs) <= {n.id for n in train.nodes} for srcs in report.origins.values())
    live = out.live_nodes()
    assert all(i in report.origins for i in live if cost.is_dispatch(out[i].op)), "a kernel of the result stands for nothing"
    for name, ids in report.rule_nodes.items():
        assert all(0 <= i < len(out) for i in ids), name
    stacked = Counter(out[i].op for i in report.rule_nodes["stacked_products"])
    # a layer's q, k, v products, their weights' gradients and q's and v's bias gradients: 3 + 3 + 2 parts
    assert stacked["part"] == 32 and stacked["concat"] >= 8 and stacked["sum_to"] == 4, stacked
    assert report.rule_modules["stacked_products"]
    assert set(report.pass_dispatches_saved) == set(counts)
    assert Counter(out[i].op for i in report.rule_nodes["attention_stats"])["attention_stats"] == 4
    assert report.rule_nodes["matmul_add"], "the rules' rows still point into the result"
    assert OptimizeReport.from_dict(report.to_dict()).to_dict() == report.to_dict()
    assert "stacked_products (pass)" in report.format_table()


def test_a_rewritten_node_keeps_the_origins_of_the_node_it_replaced():
    _, base, report = whisper_training_graph()
    before = copy.deepcopy(report)
    out, _, remap = stack_products(base)
    run_passes(base, (("stacked_products", stack_products),), report)
    parts = [(old, new) for old, new in remap.items() if out[new].op == "part" and base[old].op != "part"]
    assert len(parts) == 32   # 4 layers: q, k and v's products, weight gradients; q's and v's bias gradients
    for old, new in parts:
        assert before.origins[old] and set(before.origins[old]) <= set(report.origins[new])
    # the batched products were no node before: they stand for the products they replaced
    batched = {out[new].inputs[0] for _, new in parts}
    for b in batched:
        assert set(report.origins[b]) >= {o for old, new in parts if out[new].inputs[0] == b
                                          for o in before.origins[old]}


def test_a_pass_that_changes_nothing_leaves_the_report_as_it_was():
    graph = models.create("mlp", ["batch=8"]).build()
    out, report = optimize_inference(graph)
    again = copy.deepcopy(report)
    same, counts = run_passes(out, report=again)
    assert counts == {"stacked_products": 0, "conv_activation": 0} and same is out
    assert again == report and report.passes == {"stacked_products": 0, "conv_activation": 0}
