"""The OpenAPI document: streaming declared as text/event-stream, and a bounded schemathesis run
against the live server finding no 5xx and no undocumented status, content type or body."""
from __future__ import annotations

import zlib

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from tests.server.live import start_live_server

# One worker per module under xdist: its live server is started once.
pytestmark = pytest.mark.xdist_group("test_openapi")

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
EXAMPLES_PER_OPERATION = 6


@pytest.fixture(scope="module")
def live(engine, tmp_path_factory):
    # Generated requests may ask for many tokens; cap them so the run stays bounded.
    server = start_live_server(engine, tmp_path_factory.mktemp("openapi"), max_new_tokens_limit=2,
                               max_in_flight=4)
    yield server
    server.stop()


def test_document_declares_streams_bodies_and_security(live) -> None:
    document = httpx.get(live.base_url + "/openapi.json").json()
    prefix = "/{tenant_id}/deployments/v2/llms/{deployment_name}"
    stream = document["paths"][prefix + "/generate_stream"]["post"]
    assert list(stream["responses"]["200"]["content"]) == ["text/event-stream"]
    compat = document["paths"][prefix]["post"]["responses"]["200"]["content"]
    assert set(compat) == {"application/json", "text/event-stream"}
    generate = document["paths"][prefix + "/generate"]["post"]
    assert generate["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("GenerateRequest")
    assert "x-time-per-token" in generate["responses"]["200"]["headers"]
    assert generate["responses"]["422"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    parameters = document["components"]["schemas"]["GenerateParameters"]["properties"]
    assert {"repetition_penalty", "repitition_penalty", "schema", "merged_adapters"} <= set(parameters)
    assert generate["security"] == [{"bearer": []}]


def test_schemathesis_finds_no_server_error_or_undocumented_response(live) -> None:
    schema = schemathesis.openapi.from_url(live.base_url + "/openapi.json")
    headers = live.headers()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 6

    for operation in operations:
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                  derandomize=True, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def run(case) -> None:
            if "tenant_id" in (case.path_parameters or {}):
                # Half the cases address the real tenant and deployment, so generation runs too.
                if zlib.crc32(repr(case.body).encode()) % 2 == 0:
                    case.path_parameters = {"tenant_id": "demo", "deployment_name": live.model_name}
            case.call_and_validate(base_url=live.base_url, headers=headers, checks=CHECKS,
                                   timeout=60)

        run()
