"""``mlp``: MNIST-shaped 784-128-10 classifier with ReLU.

Parameters: ``fc1.weight`` [784, 128], ``fc1.bias``, ``fc2.weight`` [128, 10],
``fc2.bias``; files store the Linear weights [out, in] as PyTorch does.
Dataset: ten random class prototypes in [0, 1]^784, each sample a prototype plus
Gaussian noise, so a trained model scores well above chance.
"""

from __future__ import annotations

import numpy as np

from ..graph import nn
from ..graph.ir import Graph
from .base import BuiltinModel, Setting, at_most, positive

IN_FEATURES, HIDDEN, CLASSES = 784, 128, 10


class MLPModel(BuiltinModel):
    name = "mlp"
    description = "784-128-10 ReLU classifier on a synthetic MNIST-shaped dataset"
    SETTINGS = {
        "batch": Setting(32, "rows per step", positive),
        "samples": Setting(1024, "dataset size", at_most(1_000_000)),
        "noise": Setting(0.5, "std of the Gaussian noise around each class prototype",
                         lambda v: None if v >= 0 else "must be >= 0"),
    }

    def make_module(self):
        return nn.MLP(IN_FEATURES, HIDDEN, CLASSES, activation="relu",
                      init=nn.kaiming(IN_FEATURES), out_init=nn.xavier(HIDDEN, CLASSES))

    def input_names(self, train):
        return ["x", "labels"] if train else ["x"]

    def build(self, train=False, batch=None, capture=False) -> Graph:
        batch = batch or self.settings["batch"]
        g = Graph(f"mlp-{'train' if train else 'infer'}-b{batch}")
        x = g.input("x", (batch, IN_FEATURES))
        m = self.module
        hidden = g.relu(m.fc1(g, x))
        if capture:
            nn.capture(g, "fc1", hidden)
        logits = g.output("logits", m.fc2(g, hidden))
        if train:
            labels = g.input("labels", (batch,), "i32")
            g.output("loss", g.cross_entropy_loss(logits, labels))
        return g

    def dataset(self, seed=0):
        rng = np.random.default_rng(seed)
        prototypes = rng.uniform(0.0, 1.0, (CLASSES, IN_FEATURES))
        n = self.settings["samples"]
        labels = rng.integers(0, CLASSES, n).astype(np.int32)
        x = prototypes[labels] + rng.normal(0.0, self.settings["noise"], (n, IN_FEATURES))
        return {"x": x.astype(np.float32), "labels": labels}
