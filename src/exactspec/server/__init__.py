"""OpenAI-compatible HTTP server (`exactspec serve`; needs the `server` extra: fastapi, uvicorn, prometheus_client).

    from exactspec.server import create_app
    app = create_app(exactspec.load(), model_name="smollm2")

Imports are lazy so that `exactspec.server.cli` (used by the CLI parser) does not pull in FastAPI.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["create_app"]
