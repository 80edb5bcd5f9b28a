"""The HTTP APIs fuzzed from their own OpenAPI schema (schemathesis + hypothesis): whatever a client sends to
any route (/api and the OpenAI Images API at /v1), the answer is never a 5xx, never hangs, and every error is one
line of JSON naming the field."""

from __future__ import annotations

import pytest
import schemathesis
from fixtures.random_fleet import HashTextEncoder, tiny_run_config, write_random_fleet
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowfleet.sampling.card import read_card
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.serve.app import create_app
from flowfleet.serve.service import FleetService, ServeLimits
from flowfleet.stages.assemble import assemble

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    run = tmp_path_factory.mktemp("fuzz") / "run"
    write_random_fleet(str(run), tiny_run_config(3))
    model = assemble(str(run)).out
    pipe = FleetPipeline.from_pretrained(model, text_encoder=HashTextEncoder(384, 4))
    # small limits keep every valid request cheap: the fuzzer sends many
    service = FleetService(pipe, read_card(model), ServeLimits(max_steps=3, max_images=2, batch_window_ms=0))
    yield create_app(service, model, ui=False)
    service.close()


def test_no_request_gets_a_server_error_or_an_unhelpful_one(api):
    schema = schemathesis.openapi.from_asgi("/openapi.json", api)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "POST /api/generate",
        "GET /api/health",
        "GET /api/card",
        "POST /v1/images/generations",
        "GET /v1/models",
    }
    for op in operations:
        # The schema cannot say that this fleet needs a prompt (another fleet takes a label), so most bodies
        # would stop at "prompt: empty": half the cases get a generated non-empty prompt, to reach the rest.
        @given(case=op.as_strategy(), prompt=st.one_of(st.none(), st.text(min_size=1, max_size=30)))
        @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def answers_well(case, prompt):
            if prompt is not None and isinstance(case.body, dict):
                case.body["prompt"] = prompt
            response = case.call(timeout=30)
            assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
            if response.status_code >= 400:
                error = response.json()["error"]
                if case.path.startswith("/v1/"):  # OpenAI's shape: {"message", "type", "param", "code"}
                    assert set(error) == {"message", "type", "param", "code"}, error
                    error = error["message"]
                assert isinstance(error, str) and error and "\n" not in error and len(error) < 400, error
                assert "Traceback" not in response.text

        answers_well()
