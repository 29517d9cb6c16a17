"""OptimizeReport: what the optimizer did, as plain data for the CLI and the GUI."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..graph.modules import describe


def where(node) -> str:
    """The module a fused node sits in; where its modules share none, all of them (``model.norm + lm_head``)."""
    return node.module or " + ".join(node.modules)


@dataclass
class OptimizeReport:
    nodes_before: int
    nodes_after: int
    dispatches_before: int
    dispatches_after: int
    bytes_before: int
    bytes_after: int
    rules: dict[str, int] = field(default_factory=dict)            # times applied in the result
    rule_bytes_saved: dict[str, int] = field(default_factory=dict)
    matches: dict[str, int] = field(default_factory=dict)          # egglog matches during saturation
    saturated: bool = False
    stop_reason: str = "saturated"     # saturated | iteration_limit | node_limit | time_limit
    iterations: int = 0
    egraph_nodes: int = 0
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    origins: dict[int, list[int]] = field(default_factory=dict)    # optimized node id -> original node ids
    rule_nodes: dict[str, list[int]] = field(default_factory=dict)  # rule name -> optimized node ids it produced
    rule_modules: dict[str, dict[str, int]] = field(default_factory=dict)  # rule name -> {module: nodes it produced there}
    passes: dict[str, int] = field(default_factory=dict)           # graph pass after the e-graph -> rewrites
    pass_dispatches_saved: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "nodes_before": self.nodes_before, "nodes_after": self.nodes_after,
            "dispatches_before": self.dispatches_before, "dispatches_after": self.dispatches_after,
            "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
            "rules": dict(self.rules), "rule_bytes_saved": dict(self.rule_bytes_saved),
            "matches": dict(self.matches), "saturated": self.saturated, "stop_reason": self.stop_reason,
            "iterations": self.iterations, "egraph_nodes": self.egraph_nodes,
            "seconds": round(self.seconds, 6),
            "phase_seconds": {k: round(v, 6) for k, v in self.phase_seconds.items()},
            "origins": {str(k): list(v) for k, v in self.origins.items()},
            "rule_nodes": {k: list(v) for k, v in self.rule_nodes.items()},
            "rule_modules": {k: dict(v) for k, v in self.rule_modules.items()},
            "passes": dict(self.passes), "pass_dispatches_saved": dict(self.pass_dispatches_saved),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "OptimizeReport":
        """The report ``to_dict`` gave (the optimized-graph cache keeps it beside the graph)."""
        return cls(**{**d, "origins": {int(k): list(v) for k, v in d["origins"].items()}})

    def format_table(self) -> str:
        def mb(n):
            return f"{n / 1e6:,.2f} MB"
        status = "yes" if self.saturated else f"no ({self.stop_reason})"
        lines = [
            f"{'':<26}{'before':>16}{'after':>16}",
            f"{'nodes':<26}{self.nodes_before:>16,}{self.nodes_after:>16,}",
            f"{'dispatches':<26}{self.dispatches_before:>16,}{self.dispatches_after:>16,}",
            f"{'bytes moved':<26}{mb(self.bytes_before):>16}{mb(self.bytes_after):>16}",
            "",
            f"{'rule':<26}{'applied':>10}{'matches':>10}{'bytes saved':>16}  where",
        ]
        for name in self.rules:
            lines.append(f"{name:<26}{self.rules[name]:>10,}{self.matches.get(name, 0):>10,}"
                         f"{mb(self.rule_bytes_saved.get(name, 0)):>16}  {describe(self.rule_modules.get(name, {}))}")
        for name, count in self.passes.items():
            lines.append(f"{name + ' (pass)':<26}{count:>10,}{'-':>10}"
                         f"{mb(self.rule_bytes_saved.get(name, 0)):>16}  {describe(self.rule_modules.get(name, {}))}")
        lines += ["", f"saturated: {status} after {self.iterations} iterations, "
                      f"{self.egraph_nodes:,} e-nodes, {self.seconds:.2f} s"]
        return "\n".join(lines)
