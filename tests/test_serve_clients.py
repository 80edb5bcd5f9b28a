"""Clients nobody here wrote, against a real `flowfleet serve`: the official `openai` SDK on the OpenAI Images API
(/v1), Gradio's own client on the page's endpoint, and plain httpx on both JSON APIs; one server with an API key."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from fixtures.random_fleet import tiny_run_config, write_random_fleet
from fixtures.servers import serve_process
from PIL import Image

from flowfleet.stages.assemble import assemble

KEY = "test-key-7f3a"
PROMPT = "a handwritten digit seven"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, model name, native size "WxH"): the page and both APIs of a random tiny fleet, behind KEY."""
    run = tmp_path_factory.mktemp("clients") / "run"
    write_random_fleet(str(run), tiny_run_config(3))
    model = assemble(str(run)).out
    log = str(tmp_path_factory.mktemp("clients-log") / "serve.log")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLOWFLEET_API_KEY", KEY)
        with serve_process(model, ["--max-images", "4"], timeout=300, log=log) as url:
            health = httpx.get(f"{url}/api/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
            assert health["status"] == "ok"
            yield url, "model", "8x8"  # tiny_run_config: 8 x 8 pixel-space images


def pixels(b64_png: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64_png))).convert("RGB"))


def test_the_openai_sdk_generates_the_same_pixels_as_the_json_api(server):
    url, model, size = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [model]
    extra = {"seed": 3, "steps": 4, "strategy": "top2"}
    out = client.images.generate(
        model=model, prompt=PROMPT, n=2, size=size, response_format="b64_json", extra_body=extra
    )
    assert out.data is not None and len(out.data) == 2
    got = [pixels(d.b64_json) for d in out.data if d.b64_json]
    assert len(got) == 2 and got[0].shape == (8, 8, 3)
    ours = httpx.post(
        f"{url}/api/generate",
        json={"prompt": PROMPT, "n": 2, **extra},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )
    assert ours.status_code == 200, ours.text
    assert all(np.array_equal(a, pixels(b)) for a, b in zip(got, ours.json()["images"]))
    # unset: the folder's own size and the served model
    again = client.images.generate(prompt=PROMPT, extra_body=extra)
    assert again.data is not None and np.array_equal(pixels(again.data[0].b64_json or ""), got[0])


def test_the_openai_sdk_raises_its_own_errors(server):
    url, model, size = server
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.images.generate(model=model, prompt=PROMPT)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match=f"size: '1024x1024' is not this fleet's; it draws {size} only"):
        client.images.generate(model=model, prompt=PROMPT, size="1024x1024")
    with pytest.raises(openai.BadRequestError, match="response_format: only b64_json"):
        client.images.generate(model=model, prompt=PROMPT, response_format="url")
    with pytest.raises(openai.BadRequestError, match="n: expected 1..4 images, got 9"):
        client.images.generate(model=model, prompt=PROMPT, n=9)
    with pytest.raises(openai.NotFoundError, match="'dall-e-3' is not served here"):
        client.images.generate(model="dall-e-3", prompt=PROMPT)


def test_openai_errors_have_openais_shape(server):
    url, _, _ = server
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{url}/v1/images/generations", json={"prompt": PROMPT, "n": "many"}, headers=auth, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == "n" and "\n" not in error["message"]
    r = httpx.post(f"{url}/v1/images/generations", json={"prompt": PROMPT, "steps": 0}, headers=auth, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "steps"
    r = httpx.get(f"{url}/v1/models", timeout=60)  # no key
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"


def test_gradio_client_calls_the_pages_generate_endpoint(server, tmp_path):
    from gradio_client import Client

    url, _, _ = server
    client = Client(f"{url}/", auth=("anyone", KEY), download_files=str(tmp_path), verbose=False)
    assert "/generate" in client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    images, routing, summary = client.predict(PROMPT, 0, "topk", 2, 4, 2.0, 3, 2, api_name="/generate")
    assert len(images) == 2 and len(routing) == 2 and "2 image(s)" in summary
    for item in images:
        with Image.open(item["image"]) as im:  # each image enlarged for the page, by whole pixels
            assert im.size[0] % 8 == 0 and im.size[0] >= 8
