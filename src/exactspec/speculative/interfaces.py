"""The interfaces the decode loop talks to: the target model's adapter (`CausalLM`), the drafter, and the γ policy.

CausalLM. An adapter owns its KV cache: `forward` appends new tokens and returns logits for every one
of them (one pass, so verifying γ drafts costs one call), `prefill` appends without logits, `truncate`
rolls the cache back to an earlier length (rejected drafts are forgotten by a length change, not a
copy). The loop (speculative/loop.py) runs every generation as a batch of rows, so it talks to the batch
methods: `forward_rows`, `truncate_rows`, `select_rows`, `reset(batch)`, `append_rows`. An adapter whose
cache holds one sequence (transformers, encoder-decoder, a one-row llama.cpp context) inherits them from
`models.base.OneRow`, or refuses a second row (llama.cpp): a batch of at most one row, so B = 1 needs no
special case in the loop. `batched` says which kind an adapter is (batching.py decodes one-row adapters'
requests one after another); models/fast_llama.py and a llama.cpp context of several rows are batched.

Optional capabilities are named protocols below: an adapter's (`ArgmaxSteps`, `RowContexts`,
`SavedCache`, `PrefixSnapshots`, `PersistentPrefix`, `ReusablePrefix`), a drafter's (`Copies`, `Lookups`,
`ReadsPrompt`, `Finishing`) and a γ policy's (`CutsCopies`, `SpacesLookups`, `PricesArms`), each checked
by `isinstance` where a decoder, an engine or a proposal takes the object in, never probed by an
attribute's name: a new backend's (or drafter's) author implements `CausalLM` (`Drafter`) and
whichever of them it can, and the loop's paths say which they need.

How many drafts each iteration verifies is always a `GammaPolicy`: a fixed γ (`fixed_gamma.FixedGamma`)
or auto γ (autogamma/), which the loop asks once per iteration and tells what each iteration cost and
kept. What only auto γ does is split by who asks: propose cuts copies (`CutsCopies`) and spaces a
copier's lookups (`SpacesLookups`), the auto drafter prices its arms (`PricesArms`).

Drafter: propose up to k tokens (with the law they were drawn from), then hear the outcome.
Drafters never see the target model. The verifier only needs each proposed token and the draft
probabilities it was sampled from (or none, for deterministic point-mass proposals such as prompt
lookup). A drafter with nothing to propose returns an empty proposal and the loop takes a plain step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .sampling import SamplingParams


_NO_IDS: tuple[int, ...] = ()  # no tokens (not a tensor: every step asks its length)


@dataclass
class Proposal:
    ids: torch.Tensor | list[int] | tuple[int, ...]  # [k] long (k may be 0); a copy may give a list (see tokens)
    probs: torch.Tensor | None  # [k, V] warped draft probs, or None for point masses
    match: int = 0  # copying drafters: context tokens before the proposal that agree with its source

    @classmethod
    def empty(cls) -> "Proposal":
        return _EMPTY  # shared: no one writes into a proposal

    def tokens(self) -> list[int]:
        """The proposed ids as a list. Copies hand theirs over as lists: the loop reads lists, and the
        first torch call after a target pass cost ~60 us here (every step drafts)."""
        return self.ids.tolist() if isinstance(self.ids, torch.Tensor) else list(self.ids)

    def __len__(self) -> int:
        return len(self.ids)


_EMPTY = Proposal(_NO_IDS, None)


class Drafter(Protocol):
    name: str
    copies: bool  # True: proposals are copies with a match length; auto γ may cut them to any prefix

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None, law=None
    ) -> Proposal:
        """Up to k tokens to follow `context` (prompt + everything emitted so far). A stochastic drafter
        given `law` (law.TargetLaw: grammar mask, penalties) samples from
        `law.draft_probs(logits, context + drafts so far)` instead of `warp(logits, params)`."""
        ...

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """Outcome of the last proposal; drafters may adapt. Default drafters ignore it."""
        ...


@runtime_checkable
class CausalLM(Protocol):
    vocab_size: int
    eos_token_ids: set[int]
    max_length: int  # context window in tokens
    batched: bool  # the cache holds many rows (False: at most one, see OneRow)
    identity: str  # what greedy identity rests on, in words ("" where the loader did not self-test it)
    cost_key: str | None  # keys auto γ's cached T(k) (a model file and its settings; None: measured afresh)

    @property
    def length(self) -> int:
        """Number of tokens currently held in the KV cache (row 0's)."""
        ...

    def reset(self, batch: int = 1) -> None:
        """Forget every cached token; the cache then holds `batch` empty rows."""
        ...

    def forward(self, new_ids: torch.Tensor) -> torch.Tensor:
        """new_ids [1, k] appended to the cache -> logits [1, k, V] (float32)."""
        ...

    def prefill(self, new_ids: torch.Tensor) -> None:
        """Like `forward`, but computes no logits: for prompt tokens whose logits nobody reads (the
        output projection over V is a large share of a prefill on small models)."""
        ...

    def truncate(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        ...

    # --- the batch methods (the decode loop's) ---------------------------------------------------
    def forward_rows(self, new_ids: torch.Tensor, logits: bool = True) -> torch.Tensor | None:
        """new_ids [B, k]: every row appends k positions at its own length -> logits [B, k, V] (or None)."""
        ...

    def truncate_rows(self, lengths: list[int] | torch.Tensor) -> None:
        """lengths [B]: keep the first lengths[b] positions of each row."""
        ...

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) the given rows [B'], in that order."""
        ...

    def append_rows(self, prompt_ids: list[int], copies: int = 1) -> int:
        """Append `copies` rows holding prompt_ids[:-1] (through the prefix cache, if any) -> tokens reused."""
        ...


# --- optional capabilities --------------------------------------------------------------------------

@runtime_checkable
class ArgmaxSteps(Protocol):
    """A one-row greedy step that returns each position's argmax in place of its [k, V] logits."""

    def forward_argmax(self, new_ids: list[int]) -> list[int]:
        ...


@runtime_checkable
class RowContexts(Protocol):
    """A context of `max_rows` rows (llama.cpp's sequences) that scores rows of different lengths in one
    pass, unpadded (`ragged`, when its rows were found to score as they do alone), and takes a prompt in
    while other rows decode: opened, extended a chunk at a time (`chunked_prefill`), copied for a
    request's samples, or dropped."""

    max_rows: int
    ragged: bool
    kv_bytes: int  # the KV cache's size, all rows
    rope_note: str  # how positions are scaled past the training context ("" where they are not)

    @property
    def chunked_prefill(self) -> bool:
        ...

    def forward_ragged(self, ids: list[list[int]], logits: bool = True) -> torch.Tensor | None:
        """ids: each row's new tokens (any lengths, [] for none) -> logits [B, max k, V], zero-filled."""
        ...

    def forward_ragged_argmax(self, ids: list[list[int]]) -> list[list[int]]:
        ...

    def open_row(self, prompt_ids: list[int], copies: int = 1) -> tuple[int, list[int]]:
        """A new last row for a prompt -> (tokens reused from the prefix cache, the tokens left to prefill)."""
        ...

    def prefill_chunk(self, seq: int, want: int) -> int:
        """How many of `want` next prompt tokens row `seq` should prefill now (whole tiles)."""
        ...

    def extend_row(self, seq: int, ids: list[int]) -> None:
        ...

    def copy_row(self, seq: int, copies: int) -> None:
        ...

    def drop_rows(self, first: int) -> None:
        ...


@runtime_checkable
class SavedCache(Protocol):
    """The whole cache put aside and back (the batch's, while the target is lent for a measurement)."""

    def save_cache(self) -> object:
        ...

    def restore_cache(self, saved: object) -> None:
        ...


@runtime_checkable
class PrefixSnapshots(Protocol):
    """Copies of a row's KV for the prefix cache (speculative/prefix_cache.py), consulted on prefill.
    `cache_generated_kv`: whether a generation's own KV may be kept (one-token steps write what a prefill
    writes), not only its prompt's."""

    prefix_cache: object | None
    cache_generated_kv: bool

    def snapshot_prefix(self, length: int, row: int = 0) -> tuple[object, int]:
        """A copy of `row`'s KV for positions [0, length) -> (state, its bytes)."""
        ...

    def restore_prefix(self, state: object, length: int) -> None:
        """A one-row cache holding state's first `length` positions."""
        ...


@runtime_checkable
class PersistentPrefix(Protocol):
    """Snapshots that may leave the process (the prefix cache's disk store, `PrefixSpill`, keeps them across
    restarts): a state as bytes and back. `persist_key` names everything the bytes' meaning depends on (the
    model file, the engine build, the self-test's setting, the context's settings); None: not persistable."""

    persist_key: str | None

    def state_bytes(self, state: object) -> bytes:
        """A `snapshot_prefix` state as bytes (safe to call from another thread: the state is not changed)."""
        ...

    def state_from_bytes(self, ids: list[int], data: bytes) -> object:
        """The state `state_bytes` gave for a snapshot of `ids` (ExactSpecError if the bytes do not fit them)."""
        ...


class PrefixSpill(Protocol):
    """Where the prefix cache keeps snapshots beyond its memory, across restarts (exactspec.prefix_store):
    keyed by tokens; it returns only bytes it verified."""

    def longest(self, ids: list[int]) -> int:
        """The longest prefix of `ids` a kept entry holds (0: none)."""

    def load(self, ids: list[int]) -> tuple[list[int], bytes] | None:
        """(the tokens, the bytes) of the entry sharing the longest prefix with `ids`; None if it is gone
        or unreadable."""

    def keep(self, ids: list[int], data) -> None:
        """Keep the snapshot of `ids` whose bytes `data()` gives (called later, off the caller's thread)."""

    def forget(self, ids: list[int]) -> None:
        """Remove the entry of exactly `ids` (its bytes were refused by the engine): never offered again."""

    def flush(self) -> None:
        """Return once every snapshot kept so far is written (a server's shutdown waits for it)."""

    def close(self) -> None:
        """Write what is kept so far and stop (the cache is replaced or dropped)."""

    def describe(self) -> str:
        """What it holds, where (the start-up line)."""


@runtime_checkable
class ReusablePrefix(Protocol):
    """A prefill whose numerics depend on the prompt it is part of (llama.cpp's tiled prefill): how much
    of a cached match was computed as this prompt would compute it, and so may be reused."""

    def reusable(self, common: int, state: object, ids: list[int]) -> int:
        ...


@runtime_checkable
class Copies(Protocol):
    """A drafter whose proposals may be copies with a match length (`copies` True: auto γ may cut one to
    any prefix once its match is known), and where its last one came from (`source`: "context" or
    "store"; None: its own context)."""

    copies: bool
    source: str | None


@runtime_checkable
class Lookups(Copies, Protocol):
    """A copying drafter that looks matches up (prompt lookup, suffix): where it may copy from, and the
    shortest match worth a lookup (`shortest`, set by its policy alone, `set_shortest`: a shorter one
    cannot pay), its n-gram `orders` and longest match, and how long a match shorter than a lookup looks
    for is (`seen_tail`)."""

    shortest: int
    max_match: int
    orders: tuple[int, ...]

    @property
    def sources(self) -> tuple[str, ...]:
        ...

    def seen_tail(self, context: list[int], below: int) -> int:
        """The longest trailing n-gram of `context`, of an order below `below`, that occurred earlier in its
        sources (0: none, the last token is new): how long its match is, where a lookup found none."""
        ...


@runtime_checkable
class ReadsPrompt(Protocol):
    """A drafter that reads the prompt before decoding begins (the suffix drafter indexes it), so that its
    first proposal, right after the prefill, does not: the request's set-up, run before the prefill."""

    def read_prompt(self, prompt: list[int]) -> None:
        ...


@runtime_checkable
class Finishing(Protocol):
    """A drafter told when its generation ends (the suffix drafter's store keeps the output)."""

    def finish(self, context: list[int]) -> None:
        ...


@runtime_checkable
class GammaPolicy(Protocol):
    """How many drafts an iteration verifies: a fixed γ (`fixed_gamma.FixedGamma`), or chosen as decoding
    goes (auto γ: `autogamma.policy.AutoGamma`). Every row has one; rows of one request share it, and
    `propose` asks it once per iteration for all of them (`budget`). It prices a row at its context depth
    (`depth`, set by propose before the row drafts). The loop reports each iteration's time
    (`observe_step`), each proposal's outcome (`observe`) and each row's end (`finish`)."""

    depth: int | None

    def budget(self, rows: int, copying: bool) -> int:
        """Drafts to propose this iteration in a batch of `rows` (a copying drafter under a policy that
        `CutsCopies`: all it may use, cut afterwards)."""
        ...

    def observe_step(self, k: int, seconds: float, batch: int = 1, lengths: list[int] | None = None,
                     depth: int | None = None) -> None:
        """One iteration over up to k new tokens per row (row b's count in `lengths`) took `seconds`."""
        ...

    def observe(self, proposed: int, accepted: int, draft_s: float | None = None, match: int | None = None,
                kind: object = None) -> None:
        """Outcome of one proposal (its drafting time, its match length and kind of copy)."""
        ...

    def finish(self) -> None:
        """A row of this policy ended (what it has timed but kept goes into the shared costs: `observe_step`)."""
        ...


@runtime_checkable
class CutsCopies(Protocol):
    """A policy that cuts a copying drafter's proposals once their match lengths are known (auto γ): one
    width for a policy's rows (`choose`), or, on a `ragged` target in a batch, a width per row (`alphas`,
    `ragged_widths`); a batch whose copies keep being cut to nothing rests (`resting`, `batch_drafted`)."""

    ragged: bool  # the target scores each row's own tokens unpadded (priced by `ragged_widths`)

    def alphas(self, rows: list[tuple]) -> list[tuple[float, int]]:
        """(α, drafts it may keep) per row of (match length, proposal length[, kind])."""
        ...

    def choose(self, rows: list[tuple], batch: int | None = None, depth: int | None = None) -> int:
        """One width (0 = plain) for its rows of (match length, proposal length[, kind])."""
        ...

    def ragged_widths(self, alphas: list[tuple[float, int]], base: list[int],
                      left: list[int] | None = None) -> list[int]:
        """A ragged batch's drafts per row, each row scoring base[b] tokens anyway (`left`: the tokens each
        row may still emit, where the batch ends with its last row; None: each row's tokens count alone)."""
        ...

    def resting(self) -> bool:
        """Whether a batch's copies skip drafting this iteration (asked once per iteration: it counts them)."""
        ...

    def batch_drafted(self, drafted: bool) -> None:
        """Whether any copy of a batch iteration that looked up was kept."""
        ...


@runtime_checkable
class SpacesLookups(Protocol):
    """A policy that spaces a context-only copier's lookups (auto γ, speculative/lookups.py): the shortest
    match worth a lookup, written to the drafter by the policy alone (`set_shortest`), and whether a lookup
    that cannot pay yet is skipped now (`skip_lookup`)."""

    def set_shortest(self, drafter: Lookups, kinds: list[object], longest: int = 3) -> None:
        """Set `drafter.shortest` to the shortest match (at most `longest`) a copy of one of `kinds` pays at."""
        ...

    def skip_lookup(self) -> bool:
        """Whether a context-only copier's lookup, not yet able to pay, is skipped now (False: a probe is due)."""
        ...


@runtime_checkable
class PricesArms(Protocol):
    """A policy that prices a proposal before it is made (auto γ), for the auto drafter's arms: which
    copy pays most (`best`, by `min_gain`), the width a model arm's proposal pays at (`model_width`), and
    the shortest match worth an arm's lookup (`set_shortest`)."""

    min_gain: float

    def set_shortest(self, drafter: Lookups, kinds: list[object], longest: int = 3) -> None:
        ...

    def best(self, rows: list[tuple], batch: int | None = None, depth: int | None = None) -> tuple[int, float]:
        """-> (the width with the highest predicted speed-up for rows of (match, available, kind), that speed-up)."""
        ...

    def model_width(self, kind: object, k: int) -> int:
        """The width a model arm's proposal of at most k tokens pays at (0: none)."""
        ...
