"""Time optimize() on a whisper-tiny-shaped encoder graph (4 layers, width 384, 6 heads,
MLP 1536, 1500 frames, batch 1), with attention written out as an imported graph has it,
and on a 24-layer version. Prints one row per graph.

    .venv/bin/python bench/bench_optimize.py
"""

import time

from engine.optimize import optimize
from engine.optimize.synthetic import transformer

CASES = [("whisper-tiny-like (4 layers)", dict(layers=4)),
         ("24 layers, same width", dict(layers=24))]


def main():
    print(f"{'graph':<30}{'nodes':>8}{'after':>8}{'disp before':>12}{'disp after':>11}"
          f"{'MB before':>11}{'MB after':>10}{'seconds':>9}  status")
    for label, kw in CASES:
        g = transformer(width=384, heads=6, mlp=1536, seq=1500, batch=1, **kw)
        t = time.perf_counter()
        o, rep = optimize(g)
        dt = time.perf_counter() - t
        print(f"{label:<30}{len(g):>8}{len(o):>8}{rep.dispatches_before:>12}{rep.dispatches_after:>11}"
              f"{rep.bytes_before / 1e6:>11.1f}{rep.bytes_after / 1e6:>10.1f}{dt:>9.2f}  {rep.stop_reason}")


if __name__ == "__main__":
    main()
