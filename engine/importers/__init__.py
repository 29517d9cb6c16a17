"""Opening a model from what a user has: a built-in name, an ``.onnx`` file or a Hugging
Face checkpoint folder (``config.json`` + ``model.safetensors``).

``load_model(source, overrides)`` returns an object with the built-in models' interface
(``engine.models.base.BuiltinModel``): ``build(train=...)``, ``example_inputs``,
``init_params`` (an imported model's own weights), ``run(inputs, backend=...)``.
``onnx`` translates ONNX graphs op by op; ``hf`` builds the supported ``model_type``\\ s
from their configs. Both refuse what they do not handle, by name, and never approximate.
Imports ``engine.models``, ``engine.graph`` and ``engine.weights``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

from ..errors import ModelImportError
from ..models import REGISTRY, BuiltinModel, create, parse_overrides


def source_kind(source) -> str:
    """"builtin", "onnx" or "checkpoint"; a path that is none of them is an error naming what was expected."""
    text = str(source)
    if not text.strip():
        raise ModelImportError(f"the model is an empty name: give a built-in name ({', '.join(REGISTRY)}), "
                               f"an .onnx file or a checkpoint folder")
    if text in REGISTRY:
        return "builtin"
    path = Path(text)
    if path.is_dir():
        return "checkpoint"
    if path.suffix.lower() == ".onnx":
        if not path.is_file():
            raise ModelImportError(f"{text}: no such ONNX file")
        return "onnx"
    if path.exists():
        raise ModelImportError(f"{text}: not a model: give a built-in name ({', '.join(REGISTRY)}), "
                               f"an .onnx file or a checkpoint folder (config.json + model.safetensors)")
    raise ModelImportError(f"{text!r} is not a built-in model ({', '.join(REGISTRY)}), "
                           f"an .onnx file or a checkpoint folder")


def load_model(source, overrides: Iterable[str] = (), progress=None, **options) -> BuiltinModel:
    """The model ``source`` names, configured by ``--set`` strings (``["batch=8"]``).
    ``options`` go to the importer (ONNX: ``loss``, ``target``); ``progress(bytes read,
    bytes in all)`` as a checkpoint's weights are read (what it raises ends the read)."""
    kind = source_kind(source)
    if kind == "builtin":
        return create(str(source), overrides)
    settings = parse_overrides(overrides)
    if kind == "onnx":
        from .onnx import load_onnx
        return load_onnx(Path(source), settings, **options)
    from .hf import load_checkpoint
    return load_checkpoint(Path(source), settings, progress)


def load_run_model(config: Mapping, progress=None) -> BuiltinModel:
    """The model a run directory's ``config.json`` trained, opened as the run opened it
    (its source, settings and import options): what a resume trains, from the command
    line and the Studio alike. A config that names no source is a TrainingError."""
    from ..train.run import options_from_config, settings_overrides
    options = options_from_config(config)
    return load_model(options.source, settings_overrides(options.settings), progress, **options.import_options)


__all__ = ["load_model", "load_run_model", "source_kind"]
