"""Which engine replica serves a request: prefix-affine routing for the Ray Serve deployment (serve.py).

An agent session re-sends its whole conversation at every step, a prompt that starts with the previous
one; the replica that served the previous step holds that prefix's KV in its prefix cache and the
earlier answers in its output store. The front ingress (serve.py) reads each request's body and hands
the engine deployment one `ForwardedRequest`, whose `text` (the prompt, or the chat messages flattened)
the routers here can see. Three routers, `ROUTERS[name]` (`serve --routing NAME`); this module needs Ray:

    affinity    `AffinityRouter`: the replica that served the longest earlier prompt this one extends
                (the session's previous step), unless that replica's queue is full; otherwise the
                replica with the fewest requests in flight. Its state lives in the front's process.
    ray-prefix  Ray's `PrefixCacheAffinityRouter` (a prefix tree in a detached actor), fed our text.
    load        Ray's default power of two choices (queue length only).

All three honour `ForwardedRequest.replica` (pinning a request, e.g. `/metrics?replica=ID`, to one replica)
and route text-less requests (/health, /v1/models) by load.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import LocalityMixin, MultiplexMixin, RequestRouter

BLOCK_CHARS = 32  # prefixes are matched in whole blocks of this many characters
CHOOSING_S = 10.0  # a replica chosen for a request counts towards its load until the request is sent, or this long
PIN_WAIT_S = 3.0  # how long a request pinned to a replica the router has not heard of waits for it


@dataclass
class ForwardedRequest:
    """One HTTP request, whole, as the front hands it to an engine replica."""

    method: str
    path: str
    query: bytes = b""
    headers: list = field(default_factory=list)  # [(name, value)] as bytes, as ASGI has them
    body: bytes = b""
    text: str | None = None  # what routers match prefixes on (None: nothing to match)
    replica: str | None = None  # the full id of the replica this request must go to, if any


def routing_text(body: bytes) -> str | None:
    """The text a request's prefix is matched on: chat messages as 'role: content' lines, or the
    (first) raw prompt; None for a body that is not such JSON (the request is routed by load)."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    messages, prompt = request.get("messages"), request.get("prompt")
    if isinstance(messages, list):
        return "".join(f"{m.get('role')}: {_content_text(m.get('content'))}\n" for m in messages
                       if isinstance(m, dict)) or None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) and prompt else None


def _content_text(content) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def block_keys(text: str, block: int = BLOCK_CHARS) -> list[int]:
    """One key per whole block of `text`, each naming the whole prefix up to the block's end (a chain)."""
    keys, key = [], 0
    for end in range(block, len(text) + 1, block):
        key = hash((key, text[end - block:end]))
        keys.append(key)
    return keys


class PrefixTable:
    """Which replica last served each prompt prefix (at block granularity), and which prefixes were
    whole prompts (their last whole block); least recently used evicted."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity, self.owners = capacity, OrderedDict()  # key -> (replica, a whole prompt ended here)

    def record(self, text: str, replica: str) -> None:
        """`replica` served `text`: every prefix of it is now that replica's."""
        keys = block_keys(text)
        for n, key in enumerate(keys, 1):
            ended = self.owners.get(key, (None, False))[1] or n == len(keys)
            self.owners[key] = (replica, ended)
            self.owners.move_to_end(key)
        while len(self.owners) > self.capacity:
            self.owners.popitem(last=False)

    def match(self, text: str, alive) -> tuple[str | None, int]:
        """(the live replica holding the longest prefix of `text` that was a whole earlier prompt, that
        prefix's length in characters), or (None, 0). A continuation of a session extends its previous
        prompt; a shared head alone (a common system prompt) does not count, so new sessions spread."""
        best, chars = None, 0
        for n, key in enumerate(block_keys(text), 1):
            owner, ended = self.owners.get(key, (None, False))
            if owner is None:
                break
            if ended and owner in alive:
                best, chars = owner, n * BLOCK_CHARS
        return best, chars


def forwarded(pending_request) -> ForwardedRequest | None:
    """The `ForwardedRequest` a pending Serve request carries, if it is one of the front's."""
    args = getattr(pending_request, "args", None) or []
    # by name: Serve ships the router class to the front pickled, where isinstance met another copy
    return args[0] if args and type(args[0]).__name__ == ForwardedRequest.__name__ else None


def pinned(router, pending_request) -> list | None:
    """[[that replica]] for a request pinned to a replica the router knows. One it does not know yet (a
    router just started hears of replicas one by one) is waited for up to PIN_WAIT_S ([]: back off and
    ask again); after that the request is routed as any other (None), and the engine replica that gets
    it answers 404, since it is not the one asked for."""
    request = forwarded(pending_request)
    if request is None or request.replica is None:
        return None
    replica = next((r for r in router.curr_replicas.values() if r.replica_id.to_full_id_str() == request.replica),
                   None)
    if replica is not None:
        return [[replica]]
    if time.time() - pending_request.created_at < PIN_WAIT_S:
        pending_request.routing_context.should_backoff = True  # else Serve asks again at once, in a busy loop
        return []
    return None


class AffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """The replica holding the longest earlier prompt this one extends first (if not full), then every
    replica by fewest requests in flight. No FIFO mixin: the replica found for a request goes to that
    request, not to the oldest one waiting."""

    def initialize_state(self, capacity: int = 200_000) -> None:
        self.table = PrefixTable(capacity)
        self.in_flight: Counter = Counter()  # replica -> requests sent and not completed
        self.choosing: dict = {}  # id(pending request) -> (its first-ranked replica, when): chosen, not yet sent

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        ranks = pinned(self, pending_request)
        if ranks is not None:
            return ranks
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        request = forwarded(pending_request)
        owner = self.table.match(request.text, by_id)[0] if request is not None and request.text else None
        order = sorted(by_id, key=self._load_order())
        if owner is not None:
            order = [owner, *(r for r in order if r != owner)]
        if pending_request is not None and order:
            self.choosing[id(pending_request)] = (order[0], time.monotonic())
        return [[by_id[r]] for r in order]  # a full replica is skipped for the next rank

    def _load_order(self):
        """Sort key: requests in flight plus those just chosen for the replica (routing tasks choose
        concurrently, before any is sent), ties at random."""
        now, load = time.monotonic(), Counter(self.in_flight)
        for key, (replica, at) in list(self.choosing.items()):
            if now - at > CHOOSING_S:  # cancelled before it was sent
                del self.choosing[key]
            else:
                load[replica] += 1
        return lambda replica: (load[replica], random.random())

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        replica = replica_id.to_full_id_str()
        self.choosing.pop(id(pending_request), None)
        self.in_flight[replica] += 1
        request = forwarded(pending_request)
        if request is not None and request.text:
            self.table.record(request.text, replica)

    def on_request_completed(self, replica_id, internal_request_id) -> None:
        replica = replica_id.to_full_id_str()
        self.in_flight[replica] = max(0, self.in_flight[replica] - 1)


class RayPrefixRouter(PrefixCacheAffinityRouter):
    """Ray's prefix-cache affinity router, reading the forwarded text (no text: power of two choices)."""

    def _extract_text_from_request(self, pending_request) -> str | None:
        request = forwarded(pending_request)
        return request.text if request is not None and request.text else None

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        ranks = pinned(self, pending_request)
        return ranks if ranks is not None else await super().choose_replicas(candidate_replicas, pending_request)


class LoadRouter(PowerOfTwoChoicesRequestRouter):
    """Ray's default router (power of two choices on queue length), plus pinning."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        ranks = pinned(self, pending_request)
        return ranks if ranks is not None else await super().choose_replicas(candidate_replicas, pending_request)


ROUTERS = {"affinity": AffinityRouter, "ray-prefix": RayPrefixRouter, "load": LoadRouter}
DEFAULT_ROUTING = "affinity"
