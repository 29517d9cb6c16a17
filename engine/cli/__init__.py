"""The ``meganeura`` command line.

Each subcommand lives in a module of this package that calls
``registry.register_command`` when imported (``doctor``, ``commands``, ``profile``);
this module imports them and builds the parser. Any ``MeganeuraError`` a handler
raises is printed as ``meganeura: error: ...`` on stderr with exit status 2.
``--json`` output goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from .. import config
from ..errors import MeganeuraError, MeganeuraWarning
from . import commands, compare, doctor, generate, inspect, profile, runs, train, tune  # noqa: F401  (each registers its subcommands)
from .doctor import doctor_report, format_doctor
from .registry import COMMANDS, Command, check_writable, register_command

__all__ = ["main", "build_parser", "COMMANDS", "Command", "register_command", "doctor_report", "format_doctor"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meganeura",
        description="Meganeura engine: optimize, run, train and profile neural networks on wgpu.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_handler=cmd.handler, _outputs=cmd.outputs)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, MeganeuraWarning):
        print(f"meganeura: warning: {message}", file=sys.stderr, flush=True)
    else:
        _python_showwarning(message, category, filename, lineno, file, line)


_python_showwarning = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = _show_warning
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config.current()   # a bad MEGANEURA_* value: one line, whatever the command
        for option in args._outputs:
            if getattr(args, option, None):
                check_writable(getattr(args, option), option)
        status = args._handler(args)
    except MeganeuraError as exc:
        print(f"meganeura: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:   # the disk or the system refused (full, gone, no permission): not a bug to trace
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"meganeura: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("meganeura: interrupted", file=sys.stderr)
        return 130
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(main())
