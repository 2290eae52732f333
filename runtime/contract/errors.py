"""The errors edgespec raises on bad input. Each names what was wrong and what to do about it."""


class EdgespecError(Exception):
    """Base class: every error a user can cause is one of these, with a message meant for them."""


class InputError(EdgespecError, ValueError):
    """A setting, prompt or argument the runtime cannot take (a ValueError too, for callers that catch those)."""


class BundleError(EdgespecError):
    """The bundle is missing, unreadable, corrupted or of an unknown schema."""


class BackendError(EdgespecError):
    """The backend (onnxruntime) failed during a pass of a graph it had loaded: a damaged bundle, or a device or
    provider that refused (memory, a kernel it lacks). Named with the backend's own message."""


class ExportError(EdgespecError):
    """The exporter cannot produce a bundle from the given model(s) or arguments."""


class UnsupportedArchitectureError(ExportError):
    """The model's architecture has no graph builder."""


class ContextOverflowError(EdgespecError):
    """The prompt (or prompt + generation) does not fit the bundle's context."""

    partial = None  # once generation began: the Result up to where the context filled (stop reason "context_full")


class BudgetError(EdgespecError):
    """The memory budget cannot be read, or is too small for the bundle."""


class InexactRowsError(EdgespecError):
    """This device's kernels give a token other bits in another pass shape: speculation would not be exact."""


class ConstraintError(EdgespecError, ValueError):
    """A constraint (JSON schema, pattern, grammar) the grammar engine cannot compile or complete."""
