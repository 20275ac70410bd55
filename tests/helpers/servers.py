"""A real server in a thread (uvicorn, a free port) around an engine, its clients and its metrics."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from exactspec.bench.peer import free_port as _free_port

MODEL = "smol-test"


CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


SERVED = []  # every app this module serves: they share one target, one at a time


def _running(app, refs):
    """Serve `app` on a background uvicorn thread until the fixture's teardown."""
    SERVED.append(app)
    port = _free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    yield SimpleNamespace(base=base, refs=refs, app=app,
                          client=openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120))
    uv.should_exit = True
    thread.join(60)
    assert not thread.is_alive(), "uvicorn did not shut down"
    assert not app.state.worker.alive, "the worker thread outlived the app"


def metric(base: str, name: str, **labels: str) -> float:
    """One sample's value from /metrics (0 when the labelled series does not exist yet)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


WEATHER_PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]
