"""`flowfleet serve`: FleetService's checks and bounded queue, the HTTP API over a random tiny fleet,
32 concurrent clients, a monolith folder, the CLI's errors."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from fixtures.random_fleet import HashTextEncoder, randomize_, tiny_run_config, write_random_fleet
from fixtures.servers import app_in_thread
from fixtures.tolerances import gamma
from PIL import Image

from flowfleet.cli import main
from flowfleet.models.dit import DiTExpert
from flowfleet.models.files import save_model
from flowfleet.sampling.card import read_card
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.sampling.views import to_pil
from flowfleet.serve.app import create_app
from flowfleet.serve.service import BadRequest, Busy, FleetService, GenerateRequest, ServeLimits
from flowfleet.stages.assemble import assemble

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small models on a shared 2-core box

K = 3


@pytest.fixture(scope="module")
def fleet_model(tmp_path_factory) -> str:
    run = tmp_path_factory.mktemp("serve") / "run"
    cfg = tiny_run_config(K)
    write_random_fleet(str(run), cfg)
    # a monolith beside it, for the one-expert folder
    save_model(randomize_(DiTExpert.from_dit_config(cfg.expert), seed=7), str(run), "monolith", "final")
    (run / "monolith" / "status.json").write_text(json.dumps({"job": "monolith", "state": "done", "step": 9}))
    assemble(str(run), monolith=True)
    return assemble(str(run)).out


def service(model: str, **limits) -> FleetService:
    pipe = FleetPipeline.from_pretrained(model, text_encoder=HashTextEncoder(384, 4))
    return FleetService(pipe, read_card(model), ServeLimits(**limits))


def decode_png(text: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(text))).convert("RGB")


def test_http_generate_returns_the_pipelines_images_and_each_images_routing(fleet_model):
    svc = service(fleet_model)
    with app_in_thread(create_app(svc, fleet_model, ui=False)) as url:
        body = {
            "prompt": "a handwritten digit seven",
            "strategy": "top2",
            "steps": 5,
            "guidance_scale": 1.5,
            "seed": 3,
            "n": 3,
        }
        r = httpx.post(f"{url}/api/generate", json={**body, "routing": True}, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        plain = httpx.post(f"{url}/api/generate", json=body, timeout=60).json()  # routing: asked for, or absent
        card = httpx.get(f"{url}/api/card").json()
        health = httpx.get(f"{url}/api/health").json()
    # the same images as the pipeline called directly with the same settings
    pipe = FleetPipeline.from_pretrained(fleet_model, text_encoder=HashTextEncoder(384, 4))
    ref = pipe(["a handwritten digit seven"], 3, strategy="top2", steps=5, guidance_scale=1.5, seed=3)
    assert [decode_png(im).tobytes() for im in out["images"]] == [im.tobytes() for im in to_pil(ref.images)]
    assert out["prompts"] == ["a handwritten digit seven"] * 3
    assert out["settings"] == ref.settings.to_json()
    assert "routing" not in plain and plain["images"] == out["images"]
    # routing: per image, per step, two experts whose weights sum to 1, as the trace recorded them
    assert len(out["routing"]) == 3 and all(len(steps) == 5 for steps in out["routing"])
    for i, steps in enumerate(out["routing"]):
        for s, step in enumerate(steps):
            assert step["experts"] == ref.trace.experts[s][i].tolist() and len(step["experts"]) == 2
            # two float32 weights normalised to sum 1 (gamma_5), then summed in float64
            assert sum(step["weights"]) == pytest.approx(1.0, abs=gamma(5, torch.float32))
            assert len(step["probs"]) == K
    assert card["num_experts"] == K and [e["expert"] for e in card["experts"]] == list(range(K))
    assert health["served"] == 2 and health["status"] == "ok"  # (with routing, and without)


BAD_REQUESTS = [
    ({"prompt": ""}, 422, "prompt: empty"),
    ({"prompt": "   "}, 422, "prompt: empty"),
    ({"prompt": "a seven", "steps": 0}, 422, "steps: Input should be greater than or equal to 1, got 0"),
    ({"prompt": "a seven", "steps": 10**6}, 422, "steps: expected 1..200, got 1000000"),
    ('{"prompt": "a seven", "guidance_scale": NaN}', 422, "guidance_scale: Input should be a finite number, got nan"),
    (
        {"prompt": "a seven", "guidance_scale": -1},
        422,
        "guidance_scale: Input should be greater than or equal to 0, got -1",
    ),
    ({"prompt": "a seven", "guidance_scale": 31}, 422, "guidance_scale: expected a number in 0..30.0, got 31.0"),
    ({"prompt": "a seven", "guidance_max_t": 0}, 422, "guidance_max_t: Input should be greater than 0, got 0"),
    ('{"prompt": "a seven", "guidance_max_t": NaN}', 422, "guidance_max_t: Input should be a finite number, got nan"),
    ({"prompt": "a seven", "sampler": "rk4"}, 422, "sampler: Input should be 'euler' or 'heun', got 'rk4'"),
    ({"prompt": "a seven", "strategy": "topk", "k": K + 1}, 422, f"k: expected 1..{K} experts"),
    ({"prompt": "a seven", "strategy": f"top{K + 1}"}, 422, f"exceeds the {K} experts present"),
    ({"prompt": "a seven", "strategy": "best"}, 422, "strategy: unknown strategy 'best'"),
    ({"prompt": "a seven", "n": 0}, 422, "n: expected 1..8 images, got 0"),
    ({"prompt": "a seven", "seed": -1}, 422, "seed: "),
    ({"prompt": "a seven", "steps": "many"}, 422, "steps: "),
    ({"prompt": "a seven", "stepz": 3}, 422, "stepz: "),
    ({"prompt": "x" * 1001}, 422, "prompt: 1001 characters, at most 1000"),
    ('{"prompt": "\\ud800"}', 422, "prompt: not valid Unicode text"),  # a lone surrogate: valid JSON
    ({"prompt": "x" * 10_000_000}, 413, "request body: "),
    ("{not json", 422, "request body: not valid JSON"),
]


def test_bad_requests_get_a_one_line_4xx_and_the_server_is_unaffected(fleet_model):
    svc = service(fleet_model)
    with app_in_thread(create_app(svc, fleet_model, ui=False)) as url:
        for body, status, message in BAD_REQUESTS:
            if isinstance(body, str):
                r = httpx.post(
                    f"{url}/api/generate", content=body, headers={"content-type": "application/json"}, timeout=30
                )
            else:
                r = httpx.post(f"{url}/api/generate", json=body, timeout=30)
            label = str(body)[:60]
            assert r.status_code == status, (label, r.status_code, r.text[:300])
            error = r.json()["error"]
            assert message in error and "\n" not in error and len(error) < 300, (label, error)
            assert "Traceback" not in r.text
        health = httpx.get(f"{url}/api/health").json()
        ok = httpx.post(f"{url}/api/generate", json={"prompt": "a seven", "steps": 2}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["images"]) == 1
    # the checks that need the fleet ran in the service and were counted (the sampling settings' among them: they
    # are checked where they are declared, against the fleet's); nothing was generated. The request's own shape
    # (an unknown field, a body that is not JSON or too large) is refused before the service.
    assert health["bad_request"] == 18 and health["served"] == 0 and health["failed"] == 0


def test_a_full_queue_refuses_at_once_as_busy_and_the_waiting_request_is_served(fleet_model):
    svc = service(fleet_model, max_queue=1, max_batch=1, max_images=1)  # one image sampled, one waiting
    started, release = threading.Event(), threading.Event()

    def hold(done: int, total: int) -> None:  # the running request stops at its first step until released
        started.set()
        release.wait(timeout=30)

    req = GenerateRequest(prompt="a seven", steps=2)
    with ThreadPoolExecutor(2) as pool, app_in_thread(create_app(svc, fleet_model, ui=False)) as url:
        running = pool.submit(svc.generate, req, hold)
        assert started.wait(timeout=30)
        waiting = pool.submit(httpx.post, f"{url}/api/generate", json={"prompt": "a seven", "steps": 2}, timeout=60)
        deadline = time.monotonic() + 10
        while svc.admitted < 2 and time.monotonic() < deadline:  # the waiting request took its place
            time.sleep(0.01)
        t0 = time.perf_counter()
        refused = httpx.post(f"{url}/api/generate", json={"prompt": "a seven", "steps": 2}, timeout=60)
        refused_in = time.perf_counter() - t0
        with pytest.raises(Busy, match=r"busy: 2 images are already being sampled or waiting \(at most 2\)"):
            svc.generate(req)
        release.set()
        assert len(running.result(timeout=60).images) == 1
        assert waiting.result(timeout=60).status_code == 200
    assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
    assert refused.json()["error"].startswith("busy:") and refused_in < 5  # at once, not after the queue
    assert svc.counts == {"served": 2, "refused_busy": 2, "bad_request": 0, "failed": 0}
    # places are given back: a new request is served
    assert len(svc.generate(req).images) == 1


def test_32_concurrent_clients_are_each_answered_or_refused_and_none_is_lost(fleet_model):
    svc = service(fleet_model, max_queue=4)
    with app_in_thread(create_app(svc, fleet_model, ui=False)) as url:

        def client(i: int) -> int:
            body = {"prompt": f"digit {i % 10}", "steps": 4, "seed": i}
            return httpx.post(f"{url}/api/generate", json=body, timeout=120).status_code

        t0 = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(client, range(32)))
        seconds = time.perf_counter() - t0
        health = httpx.get(f"{url}/api/health").json()
        after = httpx.post(f"{url}/api/generate", json={"prompt": "a seven", "steps": 2}, timeout=60)
    assert set(codes) <= {200, 503} and len(codes) == 32
    assert codes.count(200) >= 5  # the running request and the 4 queued ones at least
    assert health["served"] == codes.count(200) and health["refused_busy"] == codes.count(503)
    assert health["failed"] == 0 and after.status_code == 200 and seconds < 120


def test_a_monolith_folder_is_served_as_one_model(fleet_model):
    mono = fleet_model.replace("/model", "/model-monolith")
    svc = service(mono)
    assert svc.card.kind == "monolith" and len(svc.card.experts) == 1
    g = svc.generate(GenerateRequest(prompt="a seven", steps=3, n=2))
    assert len(g.images) == 2 and all(step["experts"] == [0] for steps in g.routing for step in steps)
    with pytest.raises(BadRequest, match="k: expected 1..1 experts"):
        svc.check(GenerateRequest(prompt="a seven", strategy="topk", k=2))


def test_the_batchers_worker_follows_the_load_before_each_batch(fleet_model, monkeypatch):
    """On a CPU the batcher's worker holds a ThreadGovernor made in its own thread (OpenMP's thread count is per
    thread) and steps it before every batch: a request's batch is a loop of small steps."""
    from flowfleet.serve import service as service_module

    made, steps = [], []

    class Governor:
        def __init__(self):
            made.append(threading.current_thread().name)

        def step(self):
            steps.append(threading.current_thread().name)

    monkeypatch.setattr(service_module, "ThreadGovernor", Governor)
    svc = service(fleet_model)
    for seed in (1, 2):
        svc.generate(GenerateRequest(prompt="a seven", steps=2, n=1, seed=seed))
    svc.batcher.close()
    assert made == ["flowfleet-batcher"] and steps == ["flowfleet-batcher"] * 2


def test_serve_cli_refuses_bad_options_and_folders_in_one_line(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err.strip()
    assert "model_index.json: missing" in err and "\n" not in err
    assert main(["serve", str(tmp_path), "--max-queue", "-1"]) == 1
    assert "--max-queue: " in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--port", "70000"]) == 1
    assert "--port: 70000 outside 1..65535" in capsys.readouterr().err


def test_serve_nproc_2_splits_each_image_over_two_ranks_and_equals_one_process(fleet_model, tmp_path):
    """`serve --nproc 2 --parallel displaced`: rank 0 serves, both ranks sample each request. With every
    step synchronous (warm-up >= steps) displaced is exact, so the images equal one process's."""
    from fixtures.servers import serve_process

    args = ["--no-ui", "--nproc", "2", "--parallel", "displaced", "--warmup", "8"]
    body = {"prompt": "a handwritten digit seven", "strategy": "top2", "steps": 4, "seed": 5, "n": 2, "routing": True}
    with serve_process(fleet_model, args, log=str(tmp_path / "serve.log")) as url:
        first = httpx.post(f"{url}/api/generate", json=body, timeout=120)
        second = httpx.post(f"{url}/api/generate", json={**body, "seed": 6}, timeout=120)
        health = httpx.get(f"{url}/api/health").json()
    assert first.status_code == 200 and second.status_code == 200, (first.text[:300], second.text[:300])
    assert health["parallel"] == {"nproc": 2, "mode": "displaced", "warmup": 8, "ulysses_degree": None}
    assert health["served"] == 2
    pipe = FleetPipeline.from_pretrained(fleet_model)  # the folder's own text encoder, as the server's
    ref = pipe(["a handwritten digit seven"], 2, strategy="top2", steps=4, seed=5)
    assert [decode_png(im).tobytes() for im in first.json()["images"]] == [im.tobytes() for im in to_pil(ref.images)]
    assert first.json()["routing"][0][0]["experts"] == ref.trace.experts[0][0].tolist()


def test_with_an_api_key_every_api_call_needs_it(fleet_model):
    svc = service(fleet_model)
    body = {"prompt": "a seven", "steps": 2}
    with app_in_thread(create_app(svc, fleet_model, ui=False, api_key="s3cret")) as url:
        answers = {
            "none": httpx.post(f"{url}/api/generate", json=body, timeout=60),
            "wrong": httpx.post(f"{url}/api/generate", json=body, headers={"Authorization": "Bearer nope"}),
            "not bearer": httpx.get(f"{url}/api/health", headers={"Authorization": "Basic s3cret"}),
            "health": httpx.get(f"{url}/api/health"),
        }
        ok = httpx.post(f"{url}/api/generate", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=60)
        health = httpx.get(f"{url}/api/health", headers={"authorization": "bearer s3cret"}).json()
    for what, r in answers.items():
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", what
        assert r.json()["error"].startswith("authorization: ") and "\n" not in r.json()["error"], what
    assert "missing" in answers["none"].json()["error"] and "wrong key" in answers["wrong"].json()["error"]
    assert ok.status_code == 200 and len(ok.json()["images"]) == 1
    assert health["served"] == 1  # the refused calls never reached the service


def test_serving_beyond_this_machine_without_a_key_warns(fleet_model, monkeypatch, caplog):
    import uvicorn

    from flowfleet.serve import app as serve_app

    ran = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.append(kw))
    monkeypatch.setattr(serve_app.FleetService, "open", classmethod(lambda cls, model_dir, **kw: service(model_dir)))
    serve_app.serve(fleet_model, host="0.0.0.0", ui=False)
    assert "serving on 0.0.0.0 without an API key" in caplog.text
    caplog.clear()
    serve_app.serve(fleet_model, host="0.0.0.0", ui=False, api_key="k")
    serve_app.serve(fleet_model, host="127.0.0.1", ui=False)
    assert "without an API key" not in caplog.text and [kw["host"] for kw in ran] == ["0.0.0.0"] * 2 + ["127.0.0.1"]
