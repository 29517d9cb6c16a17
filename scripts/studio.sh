#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and start Meganeura Studio. Arguments go
# to meganeura-studio (e.g. MODEL --weights F --screenshot PATH). Without a
# display it renders offscreen.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
if [[ -z "${DISPLAY:-}" && -z "${WAYLAND_DISPLAY:-}" ]]; then
    export QT_QPA_PLATFORM="${QT_QPA_PLATFORM:-offscreen}"
    echo "studio: no display; running offscreen (QT_QPA_PLATFORM=$QT_QPA_PLATFORM)" >&2
fi
exec .venv/bin/meganeura-studio "$@"
