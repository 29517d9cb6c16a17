"""Choosing the next token from a step's logits, on the host: greedy at temperature 0,
else drawn from softmax(logits / T) restricted to the ``top_k`` most likely and to the
smallest set of the most likely whose probability reaches ``top_p`` (the nucleus), with
a generator seeded by ``seed``.

Why it is written as it is: a Llama-3.2-1B decode step takes 2 ms on an H100, and the
first sampler (numpy in f64 over all of Llama 3's 128,256 logits) took 4.0 ms a token
on the CI host at the Studio's default (top-p 0.9, no top-k), 4.5 ms with neither, and
over 14 ms where the nucleus is most of the vocabulary (a stable argsort of it). Each
pass over the vocabulary is one vectorised numpy operation in the logits' own dtype
(f32 from the GPU; exp in f64 alone took 1.7 ms), and nothing sequential runs over the
vocabulary: the draw finds its block of ``DRAW_BLOCK`` weights by their sums before it
adds up within one (a cumulative sum of 128,256 took 0.5 ms), and the nucleus, where the
likeliest ``NUCLEUS_SORTED`` do not reach ``top_p``, comes from the values sorted alone.
The candidates, their order and ties are those of a stable sort of the logits; their
weights are exp((logit - max) / T) in the logits' dtype, so a weight under the dtype's
smallest number (e^-103 of the likeliest's in f32) is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import MeganeuraError
from .config import check_seed

NUCLEUS_SORTED = 1024   # candidates top-p sampling ranks first
DRAW_BLOCK = 256        # weights a draw adds up one by one
FLOOR_BLOCK = 64        # values whose largest bounds largest_first's candidates from below


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy (temperature 0), else sampled with top-k
    (0: no limit) and nucleus (top-p) filtering."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise MeganeuraError(f"temperature must be a finite number >= 0, found {self.temperature}")
        if self.top_k < 0:
            raise MeganeuraError(f"top-k must be >= 0 (0: no limit), found {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise MeganeuraError(f"top-p must lie in (0, 1], found {self.top_p}")
        check_seed(self.seed)

    def choose(self, logits: np.ndarray, rng: np.random.Generator, step: str = "") -> int:
        """The next id. Logits that are NaN or +inf are an error naming ``step``: no id
        chosen from them would mean anything; so are logits that are all -inf."""
        logits = np.asarray(logits).reshape(-1)
        top = logits.max()
        if np.isnan(top) or top == np.inf:
            broken = int(np.count_nonzero(np.isnan(logits) | (logits == np.inf)))
            raise unusable_logits(step or "the logits", f"{broken} of {logits.size} logits are")
        if top == -np.inf:
            raise MeganeuraError(f"{step or 'the logits'}: every logit is -inf, so no token can be chosen")
        if self.temperature == 0:
            return int(np.argmax(logits))
        if self.top_k:
            candidates = largest_first(logits, self.top_k)
            weights = self._weights(logits[candidates], top)
            if self.top_p < 1:
                keep = reach(np.cumsum(weights, dtype=np.float64), self.top_p * weights.sum(dtype=np.float64))
                candidates, weights = candidates[:keep], weights[:keep]
            return int(candidates[draw(weights, rng)])
        weights = self._weights(logits, top)
        if self.top_p == 1:
            return draw(weights, rng)
        kept = self.nucleus(logits, weights, top)
        return int(kept[draw(weights[kept], rng)])

    def _weights(self, logits: np.ndarray, top) -> np.ndarray:
        """exp((logits - top) / T) in the logits' dtype: the probabilities, unnormalised."""
        return np.exp((logits - top) * (1.0 / self.temperature))

    def nucleus(self, logits: np.ndarray, weights: np.ndarray, top) -> np.ndarray:
        """The ids of the smallest set of the likeliest (a stable sort's order) whose
        ``weights`` reach ``top_p`` of their sum, in no particular order. The likeliest
        NUCLEUS_SORTED are ranked first (a peaked distribution's nucleus lies among them);
        otherwise the last value it takes is found from the values sorted alone."""
        target = self.top_p * weights.sum(dtype=np.float64)
        ranked = largest_first(logits, NUCLEUS_SORTED)
        cumulative = np.cumsum(weights[ranked], dtype=np.float64)
        if ranked.size == logits.size or cumulative[-1] >= target:
            return ranked[:reach(cumulative, target)]
        values = np.sort(logits)[::-1]
        count = reach_blocked(self._weights(values, top), target)
        last = values[count - 1]
        above = np.flatnonzero(logits > last)
        return np.concatenate([above, np.flatnonzero(logits == last)[:count - above.size]])


def reach(cumulative: np.ndarray, target: float) -> int:
    """How many leading weights it takes for their ``cumulative`` sum to reach ``target``
    (all of them where rounding leaves it short)."""
    return min(int(np.searchsorted(cumulative, target)) + 1, cumulative.size)


def _blocks(weights: np.ndarray) -> np.ndarray:
    """``weights`` in f64, padded with zeros to whole DRAW_BLOCKs, one a row."""
    rows = -(-weights.size // DRAW_BLOCK)
    padded = np.zeros(rows * DRAW_BLOCK, np.float64)
    padded[:weights.size] = weights
    return padded.reshape(rows, DRAW_BLOCK)


def _locate(blocks: np.ndarray, sums: np.ndarray, x: float, side: str) -> int:
    """The position in ``blocks`` (``_blocks``, flattened) where their cumulative sum passes
    ``x`` (numpy's searchsorted ``side``), its block found first by the blocks' cumulative
    ``sums``."""
    j = min(int(np.searchsorted(sums, x, side=side)), len(sums) - 1)
    inner = np.cumsum(blocks[j]) + (sums[j - 1] if j else 0.0)
    return j * DRAW_BLOCK + min(int(np.searchsorted(inner, x, side=side)), DRAW_BLOCK - 1)


def reach_blocked(weights: np.ndarray, target: float) -> int:
    """``reach`` over the cumulative sum of ``weights``, without computing all of it."""
    blocks = _blocks(weights)
    return min(_locate(blocks, np.cumsum(blocks.sum(axis=1)), target, "left") + 1, weights.size)


def draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """An index drawn with probability proportional to ``weights`` (>= 0, not all 0),
    from one ``rng.random()``: never one whose weight is 0."""
    blocks = _blocks(weights)
    sums = np.cumsum(blocks.sum(axis=1))
    at = _locate(blocks, sums, rng.random() * sums[-1], "right")
    if at >= weights.size or not weights[at] > 0:   # rounding between the sums
        positive = np.flatnonzero(weights > 0)
        at = int(positive[min(int(np.searchsorted(positive, at)), positive.size - 1)])
    return at


def largest_first(values: np.ndarray, count: int) -> np.ndarray:
    """Indices of the ``count`` largest values, largest first, equal values by index (what
    a stable sort of -values gives), without sorting them all: only the values at least
    the ``count``-th largest of the maxima of FLOOR_BLOCK-long runs (there are ``count``
    such) are candidates."""
    if count >= values.size:
        return np.argsort(-values, kind="stable")
    pool = np.flatnonzero(values >= _floor(values, count))
    pooled = values[pool]
    kth = -np.partition(-pooled, count - 1)[count - 1]   # the value alone: no index array to permute
    above = pool[pooled > kth]
    chosen = np.concatenate([above, pool[pooled == kth][:count - above.size]])
    return chosen[np.lexsort((chosen, -values[chosen]))]


def _floor(values: np.ndarray, count: int):
    """A value that at least ``count`` of ``values`` reach (-inf where the runs are fewer)."""
    runs = values.size // FLOOR_BLOCK
    if runs < count:
        return -np.inf
    maxima = values[:runs * FLOOR_BLOCK].reshape(runs, FLOOR_BLOCK).max(axis=1)
    return -np.partition(-maxima, count - 1)[count - 1]


def unusable_logits(step: str, which: str) -> MeganeuraError:
    """The error for a step whose logits hold a NaN or +inf: no token chosen from them means anything."""
    return MeganeuraError(f"{step}: {which} NaN or +inf, so no token can be chosen (the model's numbers "
                          f"overflowed, or a weight is not finite; f32 precision, MEGANEURA_PRECISION=f32, "
                          f"avoids f16's overflow)")
