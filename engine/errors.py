"""User-facing failures.

Every error a user can cause (a bad file, a wrong shape, an unknown model) is a
``MeganeuraError``: the CLI prints its message and exits 2, the GUI shows it in a
dialog and keeps running. Messages say what was wrong and what to do.
"""


class MeganeuraError(Exception):
    """Base class of every error caused by user input rather than a bug."""


class ShapeError(MeganeuraError):
    """An op was given operands whose shapes or dtypes do not fit together."""


class GraphError(MeganeuraError):
    """A graph is malformed: unknown node, missing input, bad JSON."""


class InputError(MeganeuraError):
    """Values given for a model's inputs do not fit it: a name it has no input of, a name
    given twice, an integer beyond int32, an id outside the table or classes it indexes."""


class WeightsError(MeganeuraError):
    """A weights file could not be read, or does not fit the model."""


class OutputError(MeganeuraError):
    """A file could not be written: no room left, no permission, a folder in its place
    (whatever was there before is kept)."""


class DeviceError(MeganeuraError):
    """The GPU adapter is missing, lost, or cannot hold what was asked."""


class UnknownModelError(MeganeuraError):
    """No built-in model has the requested name."""


class MeganeuraWarning(UserWarning):
    """Something the user should know that does not stop the work (the CLI prints it as
    one ``meganeura: warning:`` line; the Studio shows it in the status bar)."""


class TrainingError(MeganeuraError):
    """Training cannot go on: the loss or the gradients stopped being finite, or the
    training setup does not fit the model (unknown optimizer, schedule, data)."""


class ModelImportError(MeganeuraError):
    """A model file or checkpoint folder cannot be imported: not ONNX, truncated, an op
    or attribute the importer does not handle (all of them named), a config it does not
    know, weights that disagree with the config, an unbound dimension."""


class DataError(TrainingError):
    """Training data cannot be read or does not fit the model: a file that is not there
    or not readable, an input with no array, a wrong dtype or shape (named, expected
    against found), an empty dataset, a batch larger than the dataset."""
