#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the tests. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export QT_QPA_PLATFORM=offscreen
# one BLAS/OpenMP thread a worker: two workers' numpy products, each spinning two OpenBLAS
# threads on two cores, ran 10 reference training steps in 29 s instead of 4.6 (2026-11-26)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" \
    MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
# Python caches the bytecode of what it imports, even where the environment says not to
# (PYTHONDONTWRITEBYTECODE=1, as on the machines this project is built on): the install leaves it out
# (--no-compile, scripts/setup.sh), and without it every process of the suite (two workers,
# the bench and CLI subprocesses) compiled torch's and transformers' sources again, 11 s a
# process that imports both: the suite took 281 s instead of 256 (2026-11-27)
unset PYTHONDONTWRITEBYTECODE
# two workers, each taking whole files (fixtures shared within a file stay in one process):
# on two cores the suite ran in 234 s instead of 300 (2026-11-26)
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
