"""``meganeura runs [DIR]``: the run directories in DIR (default ``runs``) with their last
step, last loss, best validation loss and status, read from the files alone."""

from __future__ import annotations

from pathlib import Path

from ..errors import MeganeuraError
from ..train.runs import RunSummary, list_runs
from .commands import _print_json
from .registry import register_command

COLUMNS = ("run", "model", "step", "last loss", "best val loss", "status")


def _runs_arguments(parser) -> None:
    parser.add_argument("folder", metavar="DIR", nargs="?", default="runs",
                        help="a folder of run directories (written by train --run-dir), or one run directory "
                             "(default: runs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def table_row(run: RunSummary) -> tuple[str, ...]:
    step = "-" if run.last_step is None else str(run.last_step)
    if run.steps is not None:
        step += f"/{run.steps}"
    return run.name, run.model_name or "?", step, _loss(run.last_loss), _loss(run.best_val_loss), run.status


def format_table(runs: list[RunSummary]) -> str:
    rows = [COLUMNS] + [table_row(r) for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _runs(args) -> int:
    folder = Path(args.folder)
    if folder.exists() and not folder.is_dir():
        raise MeganeuraError(f"{args.folder} is a file; give the folder that holds your run directories")
    if not folder.is_dir():
        raise MeganeuraError(f"{args.folder}: no such folder; give the folder that holds your run directories "
                             f"(train --run-dir writes them under runs/ by default)")
    runs = list_runs(folder)
    if args.json:
        _print_json({"folder": str(folder), "runs": [r.to_dict() for r in runs]})
    elif runs:
        print(format_table(runs))
    else:
        print(f"no run directories in {folder}")
    return 0


register_command("runs", "the training runs in a folder: last step, last loss, best validation loss, status",
                 _runs_arguments, _runs)
