"""schemathesis over the server's OpenAPI description: no 5xx, replies match their declared schemas.

Positive and negative bodies are generated from the request models (flashllm/serving/openapi.py).
Checked per reply: not a server error, a declared status code and content type, a body matching
its schema (OpenAI's error shape for every 4xx), and invalid bodies refused. Schema-valid bodies
may still be refused (400 when prompt + max_tokens pass the context, 404 for another model name),
so "valid data is accepted" is not a check here.
"""

from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from flashllm.serving.openapi import openapi_schema
from flashllm.testing.server import ServerProcess

EXAMPLES = int(os.environ.get("FLASHLLM_FUZZ_EXAMPLES", "150"))  # per operation; with the coverage phase ~1,000 requests in all at 40
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
schema = schemathesis.openapi.from_dict(openapi_schema())
# serve --enable-lora's adapter routes, against a server of their own (an API key, an empty --allowed-lora-dir)
admin_schema = schemathesis.openapi.from_dict(openapi_schema(lora_admin=True)).include(path_regex="lora_adapter$")
SENT: list[int] = []
SENT_ADMIN: list[int] = []
# 413 (body over the route's limit: 16 KiB on the admin routes) refuses a body too; schemathesis' negative-data
# check does not count it as a refusal, so a 413 reply is checked without that one check
CHECKS_413 = [check for check in CHECKS if check is not negative_data_rejection]


def _checks(status: int) -> list:
    return CHECKS_413 if status == 413 else CHECKS


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_generated_requests_get_declared_answers(case: schemathesis.Case, fuzz_server: ServerProcess) -> None:
    response = case.call(base_url=fuzz_server.base_url, timeout=60)
    SENT.append(response.status_code)
    case.validate_response(response, checks=_checks(response.status_code))


@admin_schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_generated_lora_admin_requests_get_declared_answers(case: schemathesis.Case, lora_fuzz_server: ServerProcess,
                                                            admin_headers: dict[str, str]) -> None:
    response = case.call(base_url=lora_fuzz_server.base_url, timeout=60, headers=admin_headers)
    SENT_ADMIN.append(response.status_code)
    case.validate_response(response, checks=_checks(response.status_code))


def test_the_server_survived_and_enough_was_sent(fuzz_server: ServerProcess) -> None:
    if not SENT:
        pytest.skip("run together with test_generated_requests_get_declared_answers")
    print(f"schemathesis: {len(SENT)} requests to the API, {len(SENT_ADMIN)} to the LoRA admin routes, statuses "
          f"{dict(sorted(Counter(SENT + SENT_ADMIN).items()))}")
    assert len(SENT) >= 1000, f"only {len(SENT)} generated requests were sent"
    assert all(code < 500 or code == 503 for code in SENT)
    assert httpx.get(f"{fuzz_server.base_url}/health", timeout=10).status_code == 200
    assert "Traceback" not in fuzz_server.log()


def test_the_lora_admin_server_survived(lora_fuzz_server: ServerProcess) -> None:
    if not SENT_ADMIN:
        pytest.skip("run together with test_generated_lora_admin_requests_get_declared_answers")
    assert len(SENT_ADMIN) >= 2 * min(EXAMPLES, 100), f"only {len(SENT_ADMIN)} generated requests were sent"
    assert all(code < 500 for code in SENT_ADMIN)
    assert httpx.get(f"{lora_fuzz_server.base_url}/health", timeout=10).status_code == 200
    assert "Traceback" not in lora_fuzz_server.log()
