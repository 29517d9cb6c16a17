"""Measurements kept per adapter: the roofs (``peaks``) and the kernel tuning (``tuning``).

Each is a JSON file in the user cache folder (beside the plan cache: ``MEGANEURA_CACHE``
or platformdirs'), in a folder of its kind, one file per key: the adapter's name, its
driver, the graphics backend, the wgpu implementation, the engine version and the
format of the kind's payload, so a new driver, backend or engine measures again.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Callable

from ..compile.cache import default_cache_dir
from ..config import current
from ..version import __version__
from ..files import write_atomically


def adapter_key(info: dict, fmt: int) -> dict:
    """What a measurement of ``info``'s adapter (an ``adapter_info()``) is valid for."""
    return {"adapter": info["name"], "driver": info.get("description", ""), "backend": info["backend"],
            "wgpu": info.get("wgpu", current().wgpu), "engine": __version__, "format": fmt}


def key_file_name(key: dict) -> str:
    """The cache file of ``key``: a readable adapter name and a hash of the whole key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", key["adapter"]).strip("-")[:40] or "adapter"
    return f"{slug}-{digest}.json"


def measurements_dir(kind: str, cache_dir=None) -> Path:
    """The folder of ``kind``'s measurements: ``cache_dir``, else ``kind`` beside the plan cache."""
    return Path(cache_dir) if cache_dir is not None else default_cache_dir().parent / kind


def measurement_path(kind: str, key: dict, cache_dir=None) -> Path:
    """The file holding ``kind``'s measurement for ``key``."""
    return measurements_dir(kind, cache_dir) / key_file_name(key)


def read_measurement(kind: str, key: dict, cache_dir=None, valid: Callable[[object], bool] = bool) -> dict | None:
    """The payload stored for ``key``, or None (missing, unreadable, another key's or not ``valid``)."""
    try:
        data = json.loads(measurement_path(kind, key, cache_dir).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or not valid(data.get(kind)):
        return None
    return data[kind]


def write_measurement(kind: str, key: dict, payload: dict, cache_dir=None) -> Path:
    """Store ``payload`` under ``key`` (written to a temp file and renamed)."""
    return write_atomically(measurement_path(kind, key, cache_dir), json.dumps({"key": key, kind: payload}, indent=2, sort_keys=True),
                            make_parents=True)
