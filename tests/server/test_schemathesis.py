"""schemathesis against the server's own /openapi.json: every route with generated valid and invalid bodies, and
link-driven sequences (/v1/models -> generation routes, /tokenize -> /detokenize and /v1/completions).

Any 5xx, a response the document does not declare (status, media type, body, headers), an invalid body accepted,
or a response slower than REQUEST_TIMEOUT_S fails. The budget is small (a few dozen cases per route); the long
campaign is benchmarks/fuzz_api.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.server.apifuzz import AUTH, CHECKS, ROUTES, aim_at_model, cases, load_schema, start_server, state_machine
from tests.server.conftest import ServerProcess, wait_idle

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory, server_logs: Path) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("fuzz-model"), server_logs)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerProcess) -> Any:
    return load_schema(fuzz_server)


def test_document_lists_every_route(fuzz_server: ServerProcess) -> None:
    document = httpx.get(fuzz_server.url + "/openapi.json", headers=AUTH, timeout=10).json()
    listed = {(method.upper(), path) for path, ops in document["paths"].items() for method in ops}
    assert listed == {tuple(route.split(" ")) for route in ROUTES}
    assert httpx.get(fuzz_server.url + "/openapi.json", timeout=10).status_code == 401  # behind the key too


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_conforms(route: str, api_schema: Any, fuzz_server: ServerProcess) -> None:
    @given(case=cases(api_schema, route))
    @SETTINGS
    def check(case: Any) -> None:
        aim_at_model(case, fuzz_server.model)
        case.call_and_validate(checks=CHECKS)

    check()


def test_linked_sequences_conform(api_schema: Any, fuzz_server: ServerProcess) -> None:
    machine = state_machine(api_schema, fuzz_server.model)
    assert machine.bundles, "the document's links give the state machine no transitions"
    machine.run(settings=settings(SETTINGS, max_examples=15, stateful_step_count=6))
    wait_idle(fuzz_server, headers=AUTH)
