"""Checks on the values a user gives a graph's inputs, made before any backend runs.

The backends cannot be trusted with bad ids: the GPU's gather reads zeros past a table's
end, the reference raises a bare IndexError, and an int64 beyond int32 wraps when cast to
the i32 buffers both use. So every name is checked against the graph's inputs, every
integer against int32, and every id that picks a row (an embedding's, an ONNX Gather's) or
a class (a cross-entropy's) against that table, all found by tracing the graph itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

from ..errors import InputError
from .ir import Graph

VIEWS = ("slice", "reshape", "concat")   # ops that pass integer ids on unchanged (concat: beside others)
SHOWN = 5                                # offending values a message lists before "and N more"
INT32 = np.iinfo(np.int32)
INT32_RANGE = f"beyond the int32 range [{INT32.min}, {INT32.max}]"


@dataclass(frozen=True)
class IndexRange:
    """The ids an integer input may hold: ``low <= id < high``, or ``ignored`` (a loss's
    ignore_index). ``low`` is ``-high`` where negative ids count from the end (ONNX Gather,
    which the importer wraps with ``index_wrap``)."""

    low: int
    high: int
    ignored: int | None = None

    def describe(self) -> str:
        if self.ignored is not None:
            return f"[{self.low}, {self.high}) (or {self.ignored} to ignore a position)"
        if self.low < 0:
            return f"[{self.low}, {self.high}) (negative ids count back from the end of the table)"
        return f"[{self.low}, {self.high})"

    def outside(self, values: np.ndarray) -> np.ndarray:
        """The values this range refuses, in their order."""
        values = np.asarray(values).reshape(-1)
        bad = (values < self.low) | (values >= self.high)
        if self.ignored is not None:
            bad &= values != self.ignored
        return values[bad]

    def __and__(self, other: "IndexRange") -> "IndexRange":
        """Both ranges at once (an input read by two tables); an id is ignored only where
        every reader ignores it."""
        ignored = self.ignored if self.ignored == other.ignored else None
        return IndexRange(max(self.low, other.low), min(self.high, other.high), ignored)


def _reader_range(graph: Graph, user, current: int, wrapped: bool) -> IndexRange | None:
    """The range ``user`` imposes on its operand ``current``, if it takes ids there."""
    if user.op == "embedding" and user.inputs[1] == current:
        rows = graph.shape(user.inputs[0])[0]
        return IndexRange(-rows if wrapped else 0, rows)
    if user.op == "cross_entropy" and user.inputs[1] == current:
        return IndexRange(0, graph.shape(user.inputs[0])[-1], user.attrs.get("ignore_index", -100))
    return None


def index_ranges(graph: Graph) -> dict[str, IndexRange]:
    """Integer input -> the ids it may hold: the rows of the embedding tables and the
    classes of the losses it reaches through views (slices, reshapes, concats) and
    ``index_wrap`` (negative ids counted from the end)."""
    users = graph.users()
    ranges: dict[str, IndexRange] = {}
    for name, nid in graph.inputs.items():
        frontier, seen = [(nid, False)], set()
        while frontier:
            current, wrapped = frontier.pop()
            for uid in users[current]:
                user = graph[uid]
                if user.op in VIEWS or user.op == "index_wrap":
                    step = (uid, wrapped or user.op == "index_wrap")
                    if step not in seen:
                        seen.add(step)
                        frontier.append(step)
                elif (found := _reader_range(graph, user, current, wrapped)) is not None:
                    ranges[name] = ranges[name] & found if name in ranges else found
    return ranges


def check_input_names(graph: Graph, names: Iterable[str], owner: str) -> None:
    """An InputError naming every given name the graph has no input of (a value for
    one would otherwise be dropped without a word), beside the inputs it has."""
    unknown = [n for n in names if n not in graph.inputs]
    if not unknown:
        return
    folded = {k.casefold(): k for k in graph.inputs}
    hints = [f"{n!r} -> {folded[n.casefold()]!r}" for n in unknown if n.casefold() in folded]
    hint = f" (names are case-sensitive: {', '.join(hints)})" if hints else ""
    raise InputError(f"{owner} has no input(s) {', '.join(map(repr, unknown))}; "
                     f"its inputs are {', '.join(graph.inputs)}{hint}")


def listed(values: np.ndarray) -> str:
    """The first few distinct ``values`` (in their order) for a message, and how many
    more there are: a bad id repeated a thousand times is named once."""
    distinct, first = np.unique(np.asarray(values).reshape(-1), return_index=True)
    distinct = distinct[np.argsort(first)]
    shown = ", ".join(str(int(v)) for v in distinct[:SHOWN])
    return shown + (f" and {distinct.size - SHOWN} more" if distinct.size > SHOWN else "")


def beyond_int32(values) -> np.ndarray:
    """The integers in ``values`` that an i32 buffer cannot hold, in their order."""
    values = np.asarray(values)
    if not values.size or np.can_cast(values.dtype, np.int32):
        return values.reshape(-1)[:0]
    return IndexRange(INT32.min, INT32.max + 1).outside(values)


def integer_problems(graph: Graph, inputs: Mapping[str, np.ndarray]) -> list[str]:
    """One phrase per integer input whose values do not fit: beyond int32 (which both
    backends would wrap), or outside the table or classes it indexes."""
    ranges = index_ranges(graph)
    problems = []
    for name, nid in graph.inputs.items():
        values = np.asarray(inputs.get(name, ()))
        if graph[nid].dtype != "i32" or values.dtype.kind not in "iu":
            continue
        if (wide := beyond_int32(values)).size:
            problems.append(f"input {name!r} holds {listed(wide)}, {INT32_RANGE}")
        elif name in ranges and (bad := ranges[name].outside(values)).size:
            problems.append(f"input {name!r} holds {listed(bad)}, outside {ranges[name].describe()}")
    return problems


def check_integer_inputs(graph: Graph, inputs: Mapping[str, np.ndarray], owner: str) -> None:
    """An InputError naming every integer input that does not fit, at once."""
    problems = integer_problems(graph, inputs)
    if problems:
        raise InputError(f"{owner}: {'; '.join(problems)}")


__all__ = ["IndexRange", "index_ranges", "check_input_names", "beyond_int32", "listed", "integer_problems",
           "check_integer_inputs"]
