"""``python -m engine`` is the ``meganeura`` command."""

import sys

from .cli import main

sys.exit(main())
