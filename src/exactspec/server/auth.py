"""An API key: an ASGI middleware that answers 401 unless a request carries the key.

The key comes as `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic clients),
compared in constant time. `/health` stays public (load balancers probe it). The 401's body is in the
API's own error shape (`refuse(path)`, as the body limit's).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable

from ..errors import ExactSpecError

PUBLIC = ("/health",)
ENV = "EXACTSPEC_API_KEY"


def presented(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """The keys a request carries: its `x-api-key` and its Bearer token, each where present."""
    fields = dict(headers)
    keys = [fields[b"x-api-key"]] if b"x-api-key" in fields else []
    scheme, _, token = fields.get(b"authorization", b"").partition(b" ")
    return keys + ([token.strip()] if scheme.lower() == b"bearer" else [])


class ApiKey:
    """Wraps an ASGI app; `refuse(path)` -> (status, JSON body) of the 401."""

    def __init__(self, app, key: str, refuse: Callable[[str], tuple[int, bytes]]) -> None:
        self.app, self.key, self.refuse = app, key.encode(), refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC:
            return await self.app(scope, receive, send)
        matches = [hmac.compare_digest(given, self.key) for given in presented(scope.get("headers", []))]
        if any(matches):  # each compared (constant time): an SDK's stray header never hides the right key
            return await self.app(scope, receive, send)
        status, body = self.refuse(scope["path"])
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def read_key(key: str | None, key_file: str | None) -> str | None:
    """The key from `--api-key`, `--api-key-file` (its first line) or $EXACTSPEC_API_KEY, in that order."""
    if key is not None and key_file is not None:
        raise ExactSpecError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8-sig") as f:  # a byte-order mark (Windows editors) is not the key's
                key = f.readline().strip()
        except OSError as e:
            raise ExactSpecError(f"cannot read --api-key-file {key_file}: {e.strerror}") from None
    if key is None and ENV in os.environ:  # set but empty fails closed: never "no key" by accident
        key = os.environ[ENV].strip()
        if not key:
            raise ExactSpecError(f"${ENV} is set but empty: give a key, or unset it to serve without one")
    if key is not None and (not key or any(c.isspace() for c in key)):
        raise ExactSpecError("the API key must be non-empty and contain no spaces")
    return key
