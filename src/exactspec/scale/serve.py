"""Replicated OpenAI serving on Ray Serve: today's app (server/app.py's `create_app`), one engine per replica.

Each replica loads its own engine and builds the ordinary FastAPI app around it at replica start
(`__serve_build_asgi_app__`, Ray Serve's late-bound ingress), so every route, SSE stream, error
object and the continuous batching inside a replica are exactly the plain server's. Serve's HTTP
proxy spreads requests over the replicas; a middleware names the replica that answered in the
`x-exactspec-replica` header. `/metrics` is per replica: the registry of the replica that answered
(that header says which); scrape each replica, or sum in Prometheus.

A replica with C CPUs runs C torch threads (Ray sets OMP_NUM_THREADS = C; the engine is loaded with
threads=C). `max_ongoing_requests` is the app's `max_rows`: a replica is sent at most as many
requests as it decodes in one batch, the rest wait in Serve's queue, where autoscaling sees them and
a new or surviving replica can take them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ExactSpecError
from . import require_ray

APP_NAME = "exactspec"
REPLICA_HEADER = "x-exactspec-replica"


@dataclass
class Replicas:
    """How many engines, and how big: a fixed count, or autoscaling between min and max."""

    count: int = 1
    cpus: float = 1.0
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None

    def deployment_options(self, max_rows: int) -> dict:
        options = dict(ray_actor_options={"num_cpus": self.cpus}, max_ongoing_requests=max_rows,
                       health_check_period_s=2.0)
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

    def __init__(self, load_kwargs: dict, model_name: str, max_rows: int) -> None:
        from ..engine import load
        from ..cli_common import warm_up

        self.engine = load(**load_kwargs)
        warm_up(self.engine)  # as the plain server: γ auto measures T(k) before the replica reports ready
        self.model_name, self.max_rows = model_name, max_rows

    def __serve_build_asgi_app__(self):
        from ray import serve

        from ..server.app import create_app

        app = create_app(self.engine, self.model_name, self.max_rows)
        app.add_middleware(_ReplicaHeader, replica=serve.get_replica_context().replica_id.to_full_id_str())
        self.worker = app.state.worker
        return app

    def check_health(self) -> None:
        """Serve restarts a replica whose model thread died."""
        worker = getattr(self, "worker", None)
        if worker is not None and worker._thread.ident is not None and not worker.alive:
            raise RuntimeError("the replica's worker thread stopped")


def application(load_kwargs: dict, model_name: str, max_rows: int, replicas: Replicas):
    """The Serve application: `ExactSpecReplica` as an ingress deployment with these replicas."""
    require_ray("serve")
    from ray import serve

    threads = max(1, int(replicas.cpus))
    deployment = serve.deployment(name="ExactSpec", **replicas.deployment_options(max_rows))(
        serve.ingress()(ExactSpecReplica))
    return deployment.bind({**load_kwargs, "threads": load_kwargs.get("threads") or threads}, model_name, max_rows)


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
