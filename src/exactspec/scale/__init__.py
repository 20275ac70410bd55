"""Scale-out on Ray: replicated OpenAI serving (Ray Serve) and offline batch generation (Ray Data).

    exactspec serve --replicas 2 --cpus-per-replica 1          # serve.py: N engines behind one HTTP port
    exactspec batch in.jsonl --output out.jsonl --replicas 2   # batch.py: JSON lines over N engines

Every replica / batch worker is one ordinary `Engine` (target + drafter), so its outputs are exactly
the single-process engine's. Ray is imported lazily: without the `ray` extra the rest of exactspec
works, and these commands say what to install.
"""

from __future__ import annotations

from ..errors import ExactSpecError

PROXY_READY_S = 30  # how long Serve's controller waits for a starting HTTP proxy on a private cluster


def require_ray(*extras: str):
    """`import ray` (and `ray.<extra>` for each extra, e.g. "serve", "data"), or one clear error."""
    try:
        import importlib

        import ray

        for extra in extras:
            importlib.import_module(f"ray.{extra}")
    except ImportError as e:
        raise ExactSpecError(f"scaling out needs Ray ({e.name or 'ray'} is missing): "
                             "pip install 'exactspec[ray]'") from None
    return ray


def init_ray(address: str | None, num_cpus: float | None = None):
    """Join the cluster at `address` ("auto": the local `ray start --head`; "ray://host:10001": a remote
    one via Ray Client), or start a private one on this machine when None, with at least `num_cpus`
    logical CPUs (more replicas than cores then share the cores instead of waiting forever). Idempotent."""
    import math
    import os

    ray = require_ray()
    if ray.is_initialized():
        return ray
    try:
        if address is None:
            # Serve kills an HTTP proxy not ready within 5 s; on a busy 2-core machine its imports take
            # longer, and `serve.start` then fails. The private cluster's processes inherit this.
            os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(PROXY_READY_S))
            cpus = max(os.cpu_count() or 1, math.ceil(num_cpus or 0))
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ExactSpecError(f"cannot join the Ray cluster at {address}: {str(e).splitlines()[0][:200]}") from None
    return ray
