"""Replicated OpenAI serving on Ray Serve: today's app (server/app.py's `create_app`), one engine per replica.

Two tiers. A light front ingress (`Front`, no model) reads each HTTP request's body (413 beyond
MAX_BODY_BYTES, as the plain server), takes its prompt text (routing.py) and hands the whole request,
as one `ForwardedRequest`, to the engine deployment through a DeploymentHandle, relaying the answer
(status, headers, body chunks as they come, so SSE streams). Each engine replica (`ExactSpecReplica`)
runs the request through its own unchanged FastAPI app in-process, so every route, stream, error
object and the continuous batching inside a replica are exactly the plain server's; a middleware names
the replica that answered in the `x-exactspec-replica` header. The engine deployment's request router
(`Replicas.routing`, routing.py) sees the prompt text: by default an agent session's next step goes to
the replica holding its prefix.

`/metrics` at the front is the fleet's: every running replica's registry, each sample labelled
`replica="ID"`; `/metrics?replica=ID` is that one replica's, unlabelled.

A replica with C CPUs runs C torch threads (Ray sets OMP_NUM_THREADS = C; the engine is loaded with
threads=C). `max_ongoing_requests` is the app's `max_rows`: a replica is sent at most as many
requests as it decodes in one batch, the rest wait in the front's router queue, where autoscaling sees
them and a new or surviving replica can take them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import ExactSpecError
from ..server.limits import MAX_BODY_BYTES
from ..server.shapes import error_body
from . import require_ray

APP_NAME = "exactspec"
ENGINE_DEPLOYMENT = "ExactSpec"
REPLICA_HEADER = "x-exactspec-replica"


@dataclass
class Replicas:
    """How many engines, and how big: a fixed count, or autoscaling between min and max."""

    count: int = 1
    cpus: float = 1.0
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    routing: str = "affinity"  # routing.ROUTERS: affinity, ray-prefix or load

    def deployment_options(self, max_rows: int) -> dict:
        from ray.serve.config import RequestRouterConfig

        from .routing import ROUTERS

        router = RequestRouterConfig(request_router_class=ROUTERS[self.routing])
        options = dict(ray_actor_options={"num_cpus": self.cpus}, max_ongoing_requests=max_rows,
                       health_check_period_s=2.0, request_router_config=router)
        if self.min_replicas is None and self.max_replicas is None and self.target_ongoing_requests is None:
            return {**options, "num_replicas": self.count}
        autoscaling = dict(min_replicas=self.count if self.min_replicas is None else self.min_replicas,
                           initial_replicas=self.count,
                           max_replicas=max(self.count, self.max_replicas or self.count))
        if self.target_ongoing_requests is not None:
            autoscaling["target_ongoing_requests"] = self.target_ongoing_requests
        return {**options, "autoscaling_config": autoscaling}


class _ReplicaHeader:
    """ASGI middleware: every HTTP response carries the serving replica's id."""

    def __init__(self, app, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


class ExactSpecReplica:
    """One engine and its OpenAI app. `load_kwargs` go to `exactspec.load` (threads = the replica's CPUs)."""

    async def __init__(self, load_kwargs: dict, model_name: str, max_rows: int) -> None:
        from ray import serve

        from ..cli_common import warm_up
        from ..engine import load
        from ..server.app import create_app

        self.engine = load(**load_kwargs)
        warm_up(self.engine)  # as the plain server: γ auto measures T(k) before the replica reports ready
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        self.app = create_app(self.engine, model_name, max_rows)
        self.app.add_middleware(_ReplicaHeader, replica=self.replica_id)
        self.worker = self.app.state.worker
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()  # starts the worker and preparer threads, as uvicorn would

    async def forward(self, request):
        """Answer one `ForwardedRequest` with the app: (status, headers) first, then the body chunks."""
        if request.replica is not None and request.replica != self.replica_id:  # the router could not pin it
            yield 404, [(b"content-type", b"application/json"), (REPLICA_HEADER.encode(), self.replica_id.encode())]
            yield json.dumps(error_body(f"no running replica {request.replica}", "replica", "replica_not_found")).encode()
            return
        async for item in call_asgi(self.app, request):
            yield item

    async def __del__(self) -> None:
        """Serve's graceful shutdown of the replica: the app's shutdown, as uvicorn's (worker, preparer)."""
        await self.lifespan.__aexit__(None, None, None)

    def check_health(self) -> None:
        """Serve restarts a replica whose model thread died."""
        if self.worker._thread.ident is not None and not self.worker.alive:
            raise RuntimeError("the replica's worker thread stopped")


async def call_asgi(app, request):
    """Run `request` (a ForwardedRequest) through the ASGI `app` in this process: yields (status,
    headers), then each non-empty body chunk as the app sends it. When the caller stops early (its
    client left), the app sees http.disconnect, as from a closed connection."""
    import asyncio

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
             "query_string": request.query, "root_path": "", "headers": list(request.headers),
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    messages, left, delivered = asyncio.Queue(), asyncio.Event(), False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope, receive, messages.put))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        if task.done() and task.exception() is not None:
            raise task.exception()
    finally:
        left.set()
        if not task.done():
            await asyncio.wait({task}, timeout=5)
            task.cancel()


class Front:
    """The HTTP ingress: one light replica (no model) in front of the engine deployment. It refuses an
    oversized body (413), forwards every other request whole, with its prompt text for the router,
    and serves the fleet's /metrics."""

    def __init__(self, engine) -> None:
        self.engine = engine  # the engine deployment's DeploymentHandle

    def __serve_build_asgi_app__(self):
        from ..server.body_limit import BodyLimit

        return BodyLimit(self.asgi, limit=MAX_BODY_BYTES, refuse=_too_large)

    async def asgi(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["type"] != "http":
            return
        from urllib.parse import parse_qs

        from .routing import ForwardedRequest, routing_text

        body = b""
        message = await receive()  # BodyLimit replays the whole body in one message
        if message["type"] == "http.request":
            body = message.get("body", b"")
        replica = parse_qs(scope.get("query_string", b"").decode(errors="replace")).get("replica", [None])[0]
        if scope["path"] == "/metrics" and replica is None:
            return await self.fleet_metrics(send)
        request = ForwardedRequest(scope["method"], scope["path"], scope.get("query_string", b""),
                                   list(scope.get("headers", [])), body, routing_text(body), replica)
        await relay(self.engine.options(stream=True).forward.remote(request), send)

    async def fleet_metrics(self, send) -> None:
        """Every running engine replica's /metrics, each sample labelled with its replica."""
        from .routing import ForwardedRequest

        async def one(replica: str) -> str:
            stream = self.engine.options(stream=True).forward.remote(ForwardedRequest("GET", "/metrics", replica=replica))
            status, _ = await stream.__anext__()
            chunks = [chunk async for chunk in stream]
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {b''.join(chunks).decode(errors='replace')[:200]}")
            return b"".join(chunks).decode()

        texts, missing = {}, []
        for replica in await _running_replicas():  # one at a time: Serve gives calls made while serving
            try:                                    # one request the same internal id, which its router
                texts[replica] = await one(replica)  # indexes pending requests by
            except Exception as e:  # a replica that died since the controller listed it
                missing.append(f"# replica {replica} did not answer: {str(e).splitlines()[0][:200]}\n")
        body = (merge_metrics(texts) + "".join(missing)).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


async def relay(stream, send) -> None:
    """Send an engine replica's answer (status and headers, then chunks) to the client. A replica that
    fails before answering gets a 503; one that fails mid-answer breaks the response off."""
    started = False
    try:
        async for item in stream:
            if not started:
                status, headers = item
                await send({"type": "http.response.start", "status": status, "headers": headers})
                started = True
            else:
                await send({"type": "http.response.body", "body": item, "more_body": True})
    except Exception as e:  # the replica died or its app failed (a client that left cancels, not this)
        if started:
            raise
        body = json.dumps(error_body(f"the replica failed: {type(e).__name__}", type_="server_error",
                                     code="replica_failed")).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _too_large(path: str) -> tuple[int, bytes]:
    """The front's answer to a body over MAX_BODY_BYTES: the plain server's 413 object."""
    body = error_body(f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
    return 413, json.dumps(body).encode()


async def _lifespan(receive, send) -> None:
    """The ASGI lifespan protocol for the front (nothing to start or stop)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            return await send({"type": "lifespan.shutdown.complete"})


async def _running_replicas() -> list[str]:
    """The full ids of this application's running engine replicas (from the Serve controller)."""
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    app = serve.get_replica_context().app_name
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = await controller.get_serve_instance_details.remote()
    replicas = details["applications"][app]["deployments"][ENGINE_DEPLOYMENT]["replicas"]
    return [r["actor_name"] for r in replicas if r["state"] == "RUNNING"]


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus texts of several replicas as one: each family's HELP/TYPE once, then its samples from
    every replica, each labelled replica="ID"."""
    families: dict[str, list[str]] = {}
    for replica, text in texts.items():
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                header = families.setdefault(family, [])
                if line not in header:
                    header.append(line)
            elif line and not line.startswith("#"):
                families.setdefault(family or line.split("{")[0].split()[0], []).append(_labelled(line, replica))
    return "".join(line + "\n" for lines in families.values() for line in lines)


def _labelled(sample: str, replica: str) -> str:
    """A Prometheus sample line with replica="ID" added to its labels."""
    label = f'replica="{replica}"'
    name, brace, rest = sample.partition("{")
    if brace:
        return f"{name}{{{label},{rest}" if not rest.startswith("}") else f"{name}{{{label}{rest}"
    name, _, value = sample.partition(" ")
    return f"{name}{{{label}}} {value}"


def application(load_kwargs: dict, model_name: str, max_rows: int, replicas: Replicas):
    """The Serve application: the `Front` ingress bound to the `ExactSpecReplica` engine deployment."""
    require_ray("serve")
    from ray import serve

    threads = max(1, int(replicas.cpus))
    engine = serve.deployment(name=ENGINE_DEPLOYMENT, **replicas.deployment_options(max_rows))(ExactSpecReplica)
    front = serve.deployment(name="ExactSpecFront", num_replicas=1, max_ongoing_requests=10_000,
                             ray_actor_options={"num_cpus": 0})(serve.ingress()(Front))
    return front.bind(engine.bind({**load_kwargs, "threads": load_kwargs.get("threads") or threads}, model_name,
                                  max_rows))


def run(load_kwargs: dict, model_name: str, max_rows: int, replicas: Replicas, host: str = "127.0.0.1",
        port: int = 8000, blocking: bool = False) -> None:
    """Deploy on the connected Ray cluster (see `init_ray`) with Serve's HTTP proxy on host:port; returns
    once every replica is ready, or, `blocking`, serves until interrupted (then tears the app down)."""
    require_ray("serve")
    from ray import serve

    import sys
    import time

    start = time.perf_counter()
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(application(load_kwargs, model_name, max_rows, replicas), name=APP_NAME, route_prefix="/",
                  blocking=False)
    except RuntimeError as e:  # Serve gave up on replicas that failed to start (a model that cannot load)
        raise ExactSpecError(f"the deployment failed: {_last_error(str(e))}") from None
    if not blocking:
        return
    print(f"exactspec: {replicas.count} replica(s) ready in {time.perf_counter() - start:.1f} s: "
          f"http://{host}:{port}/v1", file=sys.stderr)
    try:
        import threading

        threading.Event().wait()
    finally:
        serve.delete(APP_NAME)


def _last_error(message: str) -> str:
    """The most telling line of Serve's multi-line failure (the replica's exception), shortened."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line]
    return (errors[-1] if errors else lines[0] if lines else "unknown error")[:300]
