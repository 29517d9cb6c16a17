"""The subcommand registry: each command module calls ``register_command`` when imported,
naming the options that are paths it will write, so that ``main`` checks them before any
work is done.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import MeganeuraError


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int | None]
    outputs: tuple[str, ...] = ()   # argparse destinations of paths the command writes


COMMANDS: dict[str, Command] = {}

def register_command(name, help, add_arguments, handler, outputs=()):
    """Add subcommand ``name``: ``add_arguments(parser)`` declares its options,
    ``handler(args)`` runs it and returns the exit status (None means 0); ``outputs``
    names the options (argparse destinations) that are paths it writes."""
    COMMANDS[name] = Command(help, add_arguments, handler, tuple(outputs))


def check_writable(path, option: str) -> None:
    """Refuse, before any work, a path the command could not write: its folder missing
    or not writable, or the path itself a folder."""
    target = Path(path).expanduser()
    folder = target.parent
    flag = "--" + option.replace("_", "-")
    if target.is_dir():
        raise MeganeuraError(f"{flag} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise MeganeuraError(f"{flag} {path}: folder {folder} does not exist")
    if target.exists() and not target.is_file():   # a device or a pipe: written into (engine.files)
        if not os.access(target, os.W_OK):
            raise MeganeuraError(f"{flag} {path}: not writable")
        return
    try:  # the file is written to a temporary one beside it, then renamed: try that much
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".meganeura-check-"):
            pass
    except OSError as e:
        raise MeganeuraError(f"{flag} {path}: cannot create a file in {folder} ({e.strerror})") from None
    if target.exists() and not os.access(target, os.W_OK):
        raise MeganeuraError(f"{flag} {path}: the file exists and is not writable")


def at_least_one(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a count of rows, steps, tokens)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value
