"""A plan's memory across one step: the bytes of live tensors while each dispatch runs,
the peak and what is alive there, and what buffer reuse saves.

Plain data from the ``ExecutionPlan`` (and, for names and exact sizes, its graph), for
``profile --json``'s ``memory`` object and the Studio's Memory view. Two kinds of
memory take part:

- pinned buffers (inputs, parameters, outputs, gradients, optimizer state, the
  training step's stats): alive for the whole step;
- pooled intermediates: each tenancy of a pooled buffer (a value written by one
  dispatch, or the partials a two-stage kernel writes into a scratch buffer) is alive
  from the dispatch that writes it to its last reader, both included. A write into a
  pooled buffer starts a new tenancy; a read (or a transfer out of it) extends the
  current one. The pool gives a buffer back only after its value's last reader, so
  tenancies of one buffer never overlap.

``live_bytes[i]`` is the pinned bytes plus the tenancies alive while dispatch ``i``
runs (its inputs and its output both count). ``allocated_bytes`` is what the plan
allocates (every buffer, at its final size); ``unshared_bytes`` what it would allocate
with no reuse (every tenancy a buffer of its own). So ``peak_bytes <= allocated_bytes
<= unshared_bytes``, and reuse saves ``unshared_bytes - allocated_bytes``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .plan import ExecutionPlan, READ_WRITE, _aligned

POOLED = "intermediate"


@dataclass
class Tenancy:
    """One value held by a pooled buffer, alive from dispatch ``first`` to ``last``."""

    buffer: int
    first: int
    last: int
    nbytes: int
    name: str


@dataclass
class MemoryTimeline:
    live_bytes: list[int]       # per plan dispatch, while it runs
    peak_bytes: int
    peak_dispatch: int          # position of the first dispatch at the peak (-1: no dispatches)
    peak_buffers: list[dict]    # what is alive there: buffer, kind, names, bytes; biggest first
    allocated_bytes: int
    unshared_bytes: int
    pinned_bytes: int

    @property
    def saved_bytes(self) -> int:
        return self.unshared_bytes - self.allocated_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "saved_bytes": self.saved_bytes}


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB."""
    units, k = ("B", "KiB", "MiB", "GiB"), 0
    while abs(n) >= 1024 and k < len(units) - 1:
        n, k = n / 1024, k + 1
    return f"{n:.0f} B" if k == 0 else f"{n:.1f} {units[k]}"


def describe_saving(unshared_bytes: int, allocated_bytes: int, peak_bytes: int) -> str:
    """What buffer reuse saves, in words (a timeline's ``unshared_bytes``,
    ``allocated_bytes`` and ``peak_bytes``; a profile's memory object calls the middle
    one ``plan_bytes``)."""
    saved = unshared_bytes - allocated_bytes
    share = 100.0 * saved / unshared_bytes if unshared_bytes else 0.0
    return (f"Buffer reuse saves {format_bytes(saved)} ({share:.0f}%): the plan allocates "
            f"{format_bytes(allocated_bytes)}, where giving every tensor a buffer of its own would take "
            f"{format_bytes(unshared_bytes)}. At most {format_bytes(peak_bytes)} of it holds live tensors at once.")


def _tenancy_name(plan: ExecutionPlan, graph, d, buffer: int) -> str:
    """The value a dispatch writes into ``buffer``: its node's name and the kernel's,
    saying whether it is the node's output or a two-stage kernel's partials; without
    the graph, the dispatch's names or kernel."""
    if graph is not None and d.nodes:
        names = ", ".join(graph[n].name or f"%{n}" for n in d.nodes)
        what = "output" if any(plan.node_buffer.get(n) == buffer for n in d.nodes) else "partials"
        return f"{names} ({what} of {d.kernel})"
    return ", ".join(d.names) or f"{d.kernel} #{d.index}"


def _tenancy_bytes(plan: ExecutionPlan, graph, d, binding) -> int:
    """A tenancy's size: its node's tensor where the graph is known, else the bytes the
    dispatch binds (which can be the whole pooled buffer it took)."""
    if graph is not None:
        for n in d.nodes:
            if plan.node_buffer.get(n) == binding.buffer:
                return _aligned(graph[n].nbytes)
    return binding.size


def tenancies(plan: ExecutionPlan, graph=None) -> list[Tenancy]:
    """Every value the step holds in a pooled buffer, in the order written."""
    pooled = {b.id for b in plan.buffers if b.kind == POOLED}
    open_: dict[int, Tenancy] = {}
    out: list[Tenancy] = []
    transfers_after: dict[int, list[int]] = {}
    for t in plan.transfers:
        transfers_after.setdefault(t.after, []).append(t.src)
    for d in plan.dispatches:
        for binding in d.bindings:
            if binding.buffer not in pooled:
                continue
            if binding.access == READ_WRITE:
                t = Tenancy(binding.buffer, d.index, d.index, _tenancy_bytes(plan, graph, d, binding),
                            _tenancy_name(plan, graph, d, binding.buffer))
                open_[binding.buffer] = t
                out.append(t)
            elif binding.buffer in open_:
                open_[binding.buffer].last = d.index
        for src in transfers_after.get(d.index, ()):
            if src in open_:
                open_[src].last = d.index
    return out


def memory_timeline(plan: ExecutionPlan, graph=None, order: list[int] | None = None) -> MemoryTimeline:
    """The plan's live bytes per dispatch, peak, what is alive at the peak, and the
    bytes allocated with and without reuse. ``graph`` (the plan's) names the pooled
    values and gives their exact sizes. ``order``: the plan dispatches a step records,
    in order (default: all of them); ``live_bytes`` and ``peak_dispatch`` follow it."""
    pinned = [b for b in plan.buffers if b.kind != POOLED]
    pinned_bytes = sum(b.nbytes for b in pinned)
    held = tenancies(plan, graph)
    n = len(plan.dispatches)
    delta = [0] * (n + 1)
    for t in held:
        delta[t.first] += t.nbytes
        delta[t.last + 1] -= t.nbytes
    per_dispatch, running = [], pinned_bytes
    for i in range(n):
        running += delta[i]
        per_dispatch.append(running)
    order = list(range(n)) if order is None else list(order)
    live = [per_dispatch[i] for i in order]
    peak_at = max(range(len(live)), key=lambda k: (live[k], -k)) if live else -1
    alive = [{"buffer": b.id, "kind": b.kind, "names": list(b.names), "bytes": b.nbytes} for b in pinned]
    if live:
        alive += [{"buffer": t.buffer, "kind": POOLED, "names": [t.name], "bytes": t.nbytes}
                  for t in held if t.first <= order[peak_at] <= t.last]
    alive.sort(key=lambda r: (-r["bytes"], r["buffer"]))
    return MemoryTimeline(live_bytes=live, peak_bytes=live[peak_at] if live else pinned_bytes,
                          peak_dispatch=peak_at, peak_buffers=alive,
                          allocated_bytes=sum(b.nbytes for b in plan.buffers),
                          unshared_bytes=pinned_bytes + sum(t.nbytes for t in held), pinned_bytes=pinned_bytes)
