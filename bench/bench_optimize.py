"""Time optimize() on the real whisper-tiny graphs (mel_len 3000, batch 1: the forward,
and the training graph = forward + backward, as build_session optimizes it), on a
whisper-tiny-shaped encoder with attention written out as an imported graph has it,
and on a 24-layer version. Prints one row per graph. Issue 3's target: the whisper-tiny
training graph in under 5 s on a 2-core machine.

    .venv/bin/python bench/bench_optimize.py
"""

import time

from engine import differentiate, models
from engine.optimize import optimize
from engine.optimize.synthetic import transformer


def whisper(train):
    model = models.create("whisper-tiny")
    graph = model.build(train=train)
    if train:
        graph, _ = differentiate(optimize(graph)[0])
    return graph


CASES = [("whisper-tiny forward", lambda: whisper(False)),
         ("whisper-tiny training", lambda: whisper(True)),
         ("whisper-like, decomposed attn", lambda: transformer(width=384, heads=6, mlp=1536, seq=1500, batch=1,
                                                               layers=4)),
         ("24 layers, decomposed attn", lambda: transformer(width=384, heads=6, mlp=1536, seq=1500, batch=1,
                                                            layers=24))]


def main():
    print(f"{'graph':<30}{'nodes':>8}{'after':>8}{'disp before':>12}{'disp after':>11}"
          f"{'MB before':>11}{'MB after':>10}{'seconds':>9}  status")
    for label, build in CASES:
        g = build()
        t = time.perf_counter()
        o, rep = optimize(g)
        dt = time.perf_counter() - t
        print(f"{label:<30}{len(g):>8}{len(o):>8}{rep.dispatches_before:>12}{rep.dispatches_after:>11}"
              f"{rep.bytes_before / 1e6:>11.1f}{rep.bytes_after / 1e6:>10.1f}{dt:>9.2f}  {rep.stop_reason}")


if __name__ == "__main__":
    main()
