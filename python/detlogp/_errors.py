"""detlogp exception classes.

Every class derives from DetlogpError and from the builtin a caller would catch: IndexError for
targets out of range, ValueError for shapes, dtypes, devices and alignment, RuntimeError for
strict-mode refusals, unavailable backends and environment knobs that detlogp refuses.
The C++ extension raises these (it imports this module when translating a detlogp::Error).
"""


class DetlogpError(Exception):
    """Base class of every error raised by detlogp."""


class InputError(DetlogpError, ValueError):
    """A shape, dtype, device, alignment or value that the operator does not take."""


class TargetIndexError(DetlogpError, IndexError):
    """A target id outside [0, real_vocab) that is not ignore_index."""


class StrictModeError(DetlogpError, RuntimeError):
    """Strict mode refused a non-contract backend, or a fallback."""


class BackendError(DetlogpError, RuntimeError):
    """The requested backend is unavailable here, or the device failed."""


class ConfigError(DetlogpError, RuntimeError):
    """A DETLOGP_* environment variable that detlogp refuses (unknown, or a frozen constant)."""


class NotImplementedYetError(DetlogpError, NotImplementedError):
    """What detlogp does not implement yet for these inputs (the sampling program on CUDA tensors,
    or under tensor parallelism); the message says what is missing and what does work."""
