#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the tests. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export QT_QPA_PLATFORM=offscreen
# two workers, each taking whole files (fixtures shared within a file stay in one process):
# on two cores the suite ran in 234 s instead of 300 (2026-11-26)
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
