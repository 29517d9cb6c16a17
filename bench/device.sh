#!/usr/bin/env bash
# Prepare the lent GPU machine (see docs/benchmarks.md): unpack the Vulkan loader carried
# in .gl and the wheels carried in .whl (wgpu, egglog and what they need; torch is the
# machine's own), then run the given command with the engine importable.
#   bash bench/device.sh python3 bench/bench_vs_torch.py
set -eo pipefail
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if ! ldconfig -p | grep libvulkan >/dev/null; then echo "device.sh: no Vulkan loader" >&2; exit 1; fi
exec "$@"
