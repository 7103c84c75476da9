"""Typed errors of the engine. Each names what went wrong by the `error_type` of the wire API (docs/api.md
section 6), so library users and HTTP users see the same failures; the HTTP status is the server's
(`server/errors.py` maps each `error_type` to one)."""
from __future__ import annotations


class EngineError(Exception):
    """Base class: a failure that concerns one request, never the engine as a whole."""

    error_type = "generation"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple:
        # Pickled whole (subclasses take other arguments than `args`): errors cross to the process
        # that answers the request when the engine runs in another one (server.cluster).
        return _restore_error, (type(self), self.args, self.__dict__)


def _restore_error(cls: type[EngineError], args: tuple, state: dict) -> EngineError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class ValidationError(EngineError):
    """A request field has a value the engine refuses; `field` names it."""

    error_type = "validation"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class AdapterNotFoundError(EngineError):
    error_type = "adapter_not_found"


class AdapterAccessError(EngineError):
    error_type = "adapter_access"


class AdapterIncompatibleError(EngineError):
    error_type = "adapter_incompatible"


class AdapterInvalidError(EngineError):
    error_type = "adapter_invalid"


class AdapterUnavailableError(EngineError):
    error_type = "adapter_unavailable"


class NonFiniteLogitsError(EngineError):
    """The model's scores for a request's next token were NaN or infinite (an adapter whose update
    overflows the forward pass, say): that request stops, the others of its batch go on. The wire's
    `generation` failure, with this message rather than torch's."""

    def __init__(self) -> None:
        super().__init__("generation stopped: the model's scores for the next token are NaN or infinite "
                         "(the forward pass overflowed, most likely from the adapter's weights)")


class RequestAbortedError(EngineError):
    """The request was cancelled (client gone, shutdown) before it finished."""

    error_type = "incomplete_generation"
