#!/usr/bin/env bash
# Set up a fresh Debian/Ubuntu machine for Meganeura Studio. Idempotent: run it
# as often as you like; it only does what is missing.
#   1. system packages: Vulkan drivers (Mesa lavapipe is the software GPU used
#      when there is no real one), the libraries Qt needs, fonts, python3-venv;
#   2. a virtual environment in .venv (Python >= 3.11);
#   3. pip install -e '.[test]' (again only when pyproject.toml or setup.py changed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

log() { echo "setup: $*" >&2; }

# --- 1. system packages ---------------------------------------------------
SYSTEM_PACKAGES=(
    mesa-vulkan-drivers libvulkan1                    # wgpu: Vulkan (lavapipe without a GPU)
    libegl1 libgl1 libxkbcommon0 libfontconfig1       # PySide6, offscreen included
    libdbus-1-3 libglib2.0-0 fonts-dejavu-core
    python3 python3-venv
)
missing=()
if command -v dpkg-query >/dev/null 2>&1; then
    for pkg in "${SYSTEM_PACKAGES[@]}"; do
        if [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)" != "install ok installed" ]]; then
            missing+=("$pkg")
        fi
    done
fi
if (( ${#missing[@]} )); then
    if [[ $(id -u) -eq 0 ]]; then
        SUDO=()
    elif command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo)
    else
        SUDO=(none)
    fi
    if [[ "${SUDO[*]}" == none ]] || ! command -v apt-get >/dev/null 2>&1; then
        log "warning: cannot install system packages (not root, no sudo or no apt-get): ${missing[*]}"
    else
        log "installing system packages: ${missing[*]}"
        "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
        "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
    fi
fi

# --- 2. virtual environment -----------------------------------------------
version_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }

if [[ -x .venv/bin/python ]] && ! version_ok .venv/bin/python; then
    log "error: .venv has Python older than 3.11; remove .venv and run again" && exit 1
fi
if [[ ! -x .venv/bin/python ]]; then
    PYTHON=""
    for candidate in "${MEGANEURA_PYTHON:-}" python3.13 python3.12 python3.11 python3; do
        if [[ -n "$candidate" ]] && command -v "$candidate" >/dev/null 2>&1 && version_ok "$candidate"; then
            PYTHON="$candidate"
            break
        fi
    done
    if [[ -z "$PYTHON" ]]; then
        log "error: Python >= 3.11 not found; install python3 (Debian 12 has 3.11)" && exit 1
    fi
    log "creating .venv with $PYTHON ($("$PYTHON" --version 2>&1))"
    rm -rf .venv
    "$PYTHON" -m venv .venv
fi

# --- 3. the project and its test dependencies -----------------------------
stamp=.venv/.meganeura-installed
want="$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)"
if [[ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]] \
    || ! .venv/bin/python -c 'import engine.cli, app.main' >/dev/null 2>&1 \
    || [[ ! -x .venv/bin/meganeura ]]; then
    log "installing the project into .venv (pip install -e '.[test]')"
    .venv/bin/python -m pip install -q --upgrade pip
    # --no-compile: byte-compiling every module of torch and transformers took 40 of the
    # install's 72 s (2026-11-26); Python compiles what it imports when it imports it
    .venv/bin/python -m pip install -q --no-compile -e '.[test]'
    echo "$want" > "$stamp"
fi
log "ready (.venv/bin/meganeura doctor describes the GPU adapter)"
