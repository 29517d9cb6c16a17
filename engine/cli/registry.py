"""The subcommand registry: each command module calls ``register_command`` when imported.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int | None]


COMMANDS: dict[str, Command] = {}

def register_command(name, help, add_arguments, handler):
    """Add subcommand ``name``: ``add_arguments(parser)`` declares its options,
    ``handler(args)`` runs it and returns the exit status (None means 0)."""
    COMMANDS[name] = Command(help, add_arguments, handler)
