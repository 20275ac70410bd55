"""What auto γ has learned about a drafter's proposals: acceptance by match length and kind.

Where the paper's i.i.d. model holds, and where it does not. E[tokens] = (1 - α^(γ+1)) / (1 - α)
assumes every draft is accepted with the same probability α, independently of the others: a fair
model of a draft MODEL's proposals (model drafters keep it: one α, bucket 0 below). Prompt lookup
breaks it: its proposals are copies of earlier text, and whether the next copied token is right
depends on how long the copy has been right so far — inside a long copy (an edit's untouched lines)
runs of tens of tokens are accepted whole, right after an edit point or on a one-token match almost
nothing is. One global α averages those regimes, so it is too low to dare a 32-token proposal inside
a copy and too high to stay out of a fresh one. What replaces it: α conditioned on the proposal's
MATCH LENGTH (how many context tokens before the proposal agree with the text it copies: the
drafter reports it), in buckets 1, 2, 3-4, 5-8, 9-16, 17-32, 33+, each a Beta posterior updated
with exponential forgetting (recent proposals weigh most). Within a bucket the per-token model is
the paper's again, so the policy chooses, per proposal, the γ with the best E[tokens | match] /
cost, over the T(k) measured up to the largest γ it may use (32). The buckets' priors rise with
the match length, so a first request speculates on the copies it finds at once instead of decoding
plainly until a global α is convinced (which a short answer never outlives); what the engine learns
(bucket posteriors, T(k), T(B, k)) lives on the Engine and carries across requests.

"""

from __future__ import annotations


# Match-length buckets: bucket 0 = no match information (model drafters: the paper's one α).
BUCKET_EDGES = (1, 2, 3, 5, 9, 17, 33)  # bucket b >= 1 holds match lengths in [EDGES[b-1], EDGES[b])
COPY_PRIOR = (0.5, 0.6, 0.7, 0.8, 0.88, 0.93, 0.96)  # prior α per bucket 1..7: longer matches copy on
# The store (other requests' text) is a weaker witness at the same match length: measured on the
# bench's chat, edit, agent and agent-repeat with the embedded model, its copies of matches up to 8
# tokens were accepted 0.1-0.5 of the time (the context's 0.4-0.8); of 9 and more, 0.55-1.
STORE_PRIOR = (0.2, 0.3, 0.45, 0.6, 0.8, 0.9, 0.95)
FORGET = 0.97  # each proposal's outcome discounts its bucket's earlier evidence (memory ~30 proposals)


def bucket(match: int | None) -> int:
    """Match length -> bucket (0: unknown / not a copy)."""
    if not match:
        return 0
    if match < len(_BUCKETS):  # every proposal's α is looked up by its match length
        return _BUCKETS[match]
    return sum(match >= edge for edge in BUCKET_EDGES)


_BUCKETS = [sum(m >= edge for edge in BUCKET_EDGES) for m in range(2 * BUCKET_EDGES[-1])]


class Acceptance:
    """What the engine has learned about one drafter: per match-length bucket, a Beta posterior of the
    per-token acceptance α (accepted drafts are successes, the first rejection a failure), with
    exponential forgetting. Shared by every request of an Engine (server, generate_batch, bench).

    Proposals of different kinds are priced apart (`of(key)`): a copying drafter's key says where the
    copy came from (the request's own context, or the store of earlier requests and siblings: the
    latter may be a weaker witness at the same match length) and whether the row samples. At T = 0 a
    copied token is kept when it is the argmax; at T > 0 it is kept with probability p(x), so a
    sampled row's copy is accepted less often and its long proposals are worth less: each kind learns
    its own α per match length, and auto γ and the auto drafter choose from the kind at hand. A kind
    starts from its source's prior (the store's is lower: STORE_PRIOR): a cold server's first requests
    otherwise pay for each short store copy until its bucket has learnt."""

    def __init__(self, prior_alpha: float = 0.3, prior_strength: float = 4.0, copy_prior: tuple = COPY_PRIOR):
        self.priors = priors = (prior_alpha, *copy_prior)  # α per bucket before any outcome
        self.prior_alpha, self.prior_strength = prior_alpha, prior_strength
        self.successes = [a * prior_strength for a in priors]
        self.failures = [(1.0 - a) * prior_strength for a in priors]
        self.proposals = [0] * len(priors)
        self.keyed: dict[object, Acceptance] = {}

    def of(self, key: object = None) -> "Acceptance":
        """The posterior of one kind of proposal (None: this one)."""
        if key is None:
            return self
        if key not in self.keyed:
            store = isinstance(key, tuple) and key[:1] == ("store",)
            self.keyed[key] = Acceptance(self.prior_alpha, self.prior_strength, STORE_PRIOR if store else COPY_PRIOR)
        return self.keyed[key]

    def alpha(self, match: int | None = None) -> float:
        b = bucket(match)
        return self.successes[b] / (self.successes[b] + self.failures[b])

    def observe(self, proposed: int, accepted: int, match: int | None = None) -> None:
        if not proposed:
            return
        b = bucket(match)
        forget = FORGET if b else 1.0  # bucket 0 keeps the paper's stationary α
        self.successes[b] = forget * self.successes[b] + accepted
        self.failures[b] = forget * self.failures[b] + (accepted < proposed)
        self.proposals[b] += 1

    def to_dict(self) -> dict:
        out = {"bucket_edges": list(BUCKET_EDGES), "alpha": [self.alpha_of(b) for b in range(len(self.proposals))],
               "proposals": list(self.proposals)}
        if self.keyed:
            out["by_kind"] = {"/".join(map(str, k)) if isinstance(k, tuple) else str(k): a.to_dict()
                              for k, a in self.keyed.items()}
        return out

    def alpha_of(self, b: int) -> float:
        return self.successes[b] / (self.successes[b] + self.failures[b])


LOCAL_STRENGTH = 4.0  # the most proposals' weight a request's view takes from the engine's history, per bucket:
# the priors' own strength, so that a request is never slower to learn than on a fresh engine
BOLD_FROM = bucket(9)  # the bucket (matches of 9+) from which a cautious view starts as bold as the history (`_View`)
TILT_PRIOR = 4.0  # drafted tokens' weight of "as the history predicts" in a request's tilt (`_View.tilt`)
TILT_RANGE = (0.25, 2.0)  # the most a request's own outcomes scale the history's odds, down or up


class RequestAcceptance:
    """One request's view of what the engine learned (`Acceptance`): the same kinds and match buckets, each
    starting from the engine's α at that moment but weighing its history as at most LOCAL_STRENGTH
    proposals, then moved by this request's own outcomes (which the engine learns too).

    The engine's posterior carries the weight of ~30 recent proposals (FORGET), all of earlier traffic.
    After agent steps whose long copies were accepted whole, an edit that rewrites its file instead of
    copying it was priced as the agent steps were: each of its rejected 17-33-token proposals moved the
    engine's α by a thirtieth, so it kept paying for wide passes for tens of proposals (measured in
    docs/drafters.md, scripts/bench_mixed.py). Its own view drops below paying after a few. A request's
    samples, and the prompts of one `generate_batch` call, share one view (`generation.Request.views`):
    a batch's rows make a few proposals each, too few to learn from alone.

    `cautious` (a `generate_batch` call's view): its buckets of matches shorter than BOLD_FROM's start no
    higher than a fresh engine's prior. A short match is a copy in one workload and chance in another,
    and in a batch a drafted token costs about a row's step: after agent steps whose short matches were
    copied on whole, the first batch of chat prompts drafted wide on its first short match and kept
    almost nothing. Lone requests keep the history's boldness: agent steps after agent steps need it
    (capped there too, they ran slower; both measured in docs/drafters.md)."""

    def __init__(self, shared: Acceptance, strength: float = LOCAL_STRENGTH, cautious: bool = False):
        self.shared, self.strength, self.cautious = shared, strength, cautious
        self._kinds: dict[object, _View] = {}

    def of(self, key: object = None) -> "_View":
        view = self._kinds.get(key)
        if view is None:
            view = self._kinds[key] = _View(self.shared.of(key), self.strength, BOLD_FROM if self.cautious else 0)
        return view

    def alpha(self, match: int | None = None) -> float:
        return self.of(None).alpha(match)

    def observe(self, proposed: int, accepted: int, match: int | None = None) -> None:
        self.of(None).observe(proposed, accepted, match)


class _View:
    """One kind's buckets as a request sees them (RequestAcceptance), the history's part of every bucket
    tilted by how this request's copies fare against it (`tilt`)."""

    def __init__(self, shared: Acceptance, strength: float, bold_from: int = 0):
        self.shared, self.strength, self.bold_from = shared, strength, bold_from
        self.successes: list[float | None] = [None] * len(shared.successes)  # None: not looked at yet
        self.failures: list[float] = [0.0] * len(shared.successes)
        self.history: list[float] = [0.0] * len(shared.successes)  # the history's share of `successes`
        self.kept = self.expected = 0.0  # drafts this request kept, and what its untilted buckets expected of them

    def _bucket(self, match: int | None) -> int:
        b = bucket(match)
        if self.successes[b] is None:  # the engine's α now, weighing at most `strength` proposals ...
            s, f = self.shared.successes[b], self.shared.failures[b]
            weight = min(s + f, self.strength) / (s + f)
            s, f = s * weight, f * weight
            prior = self.shared.priors[b]
            if 0 < b < self.bold_from and s / (s + f) > prior:  # ... no higher than the prior: `cautious`
                s, f = prior * (s + f), (1.0 - prior) * (s + f)
            self.successes[b], self.failures[b], self.history[b] = s, f, s
        return b

    @property
    def tilt(self) -> float:
        """How this request's copies fare against what its buckets, untilted, expected of them, over every bucket:
        (kept + TILT_PRIOR) / (expected + TILT_PRIOR), within TILT_RANGE. The history's odds of every bucket
        are scaled by it: a paraphrase whose short copies fail is not priced, at its first long match, as
        the agent steps before it whose copies were kept (each bucket alone learns from its own few
        proposals a request makes, and every request begins at the engine's α)."""
        return min(max((self.kept + TILT_PRIOR) / (self.expected + TILT_PRIOR), TILT_RANGE[0]), TILT_RANGE[1])

    def alpha(self, match: int | None = None) -> float:
        b = self._bucket(match)
        extra = self.history[b] * (self.tilt - 1.0)  # the history's successes scaled by the tilt
        return (self.successes[b] + extra) / (self.successes[b] + self.failures[b] + extra)

    def observe(self, proposed: int, accepted: int, match: int | None = None) -> None:
        if not proposed:
            return
        self.shared.observe(proposed, accepted, match)
        b = self._bucket(match)
        s, f = self.successes[b], self.failures[b]
        a = min(s / (s + f), 1.0 - 1e-9)  # the bucket's α untilted: what this proposal was expected to keep
        self.expected += a * (1.0 - a ** proposed) / (1.0 - a)
        self.kept += accepted
        forget = FORGET if b else 1.0
        self.successes[b] = forget * s + accepted
        self.failures[b] = forget * f + (accepted < proposed)
        self.history[b] *= forget
