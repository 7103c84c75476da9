"""HTTP statuses are the server's: every error type the engine, the registry and the cluster raise has
one in `server.errors.STATUS_OF_ERROR_TYPE`, and the runtime's errors carry none."""
from __future__ import annotations

import inspect

from lora_runtime import errors as runtime_errors
from lora_runtime.api import EngineError
from server.cluster import remote
from server.errors import STATUS_OF_ERROR_TYPE, ServiceError, from_engine_error
from server.registry import errors as registry_errors


def _error_classes() -> list[type]:
    modules = (runtime_errors, registry_errors, remote)
    return [cls for module in modules for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, (EngineError, ServiceError)) and cls.__module__ == module.__name__]


def test_every_error_type_has_a_status_and_no_error_carries_one() -> None:
    classes = _error_classes()
    assert len(classes) >= 18  # the runtime's, the registry's and the cluster's
    for cls in classes:
        assert cls.error_type in STATUS_OF_ERROR_TYPE, cls
        assert not hasattr(cls, "status_code"), cls


def test_registry_errors_are_the_services_not_the_runtimes() -> None:
    assert not issubclass(registry_errors.RegistryError, EngineError)


def test_an_overload_gets_retry_after_and_a_validation_its_field() -> None:
    overloaded = from_engine_error(remote.ClusterOverloadedError("full"), retry_after_s=3)
    assert (overloaded.status_code, overloaded.headers) == (429, {"Retry-After": "3"})
    refused = from_engine_error(runtime_errors.ValidationError("top_k", "must be >= 1"), retry_after_s=3)
    assert (refused.status_code, refused.param, refused.headers) == (422, "top_k", {})
