"""What an answer rewrites of the prompt it copies, learned while it is written, so that copies run through it.

A reformatting answer (pretty-printed JSON, a renamed variable, a changed tense) copies its input
between small rewrites: SmolLM2 writes the prompt's `"Alice",` ` "email"` as `"Alice",` `\\n ` ` "email"`,
one token inserted per line. Prompt lookup loses the copy at each: the context's tail `",` `\\n ` is
nowhere in the prompt, and the copy starts again only after a plain step or two.

`Rewrites` follows the answer along the prompt: `aligned` is (the answer's last token, the prompt
token it copies). After each commit the alignment walks on over tokens the answer copied as they are
and over rewrites it already knows. Where it stops, the answer left the copy; once the answer copies
the prompt again (MIN_MATCH tokens, within MAX_GAP on either side), the tokens between are a rule:
these prompt tokens became those answer tokens (an insertion: the next prompt token became the inserted
ones and it). A drafter copying from the prompt then writes each rule's output in place of its input
(`follow`), so the copy runs on through the next line break.

Each rule counts, per prompt token before it (`left`), how often the answer wrote it there and how often
it copied the input as it is: a proposal of it kept or not, the answer writing it or copying past it
unprompted (`Rule.count`, once per prompt position). That count decides after a token seen before
(` "` is rewritten after a value's `",` and `,`, not after a key's `":`); after a new token the rule
is written only if it was kept after two others (a rename, not a format's one place) and more often
proposed and kept than not. Where the last outcome after a token went against its count (`doubtful`:
the answer's `["English", "French"]` stays on one line in a file whose other commas break lines), or
after a new token where the rule is not trusted though the answer wrote it twice elsewhere, the copy
stops before it and the target's next token settles it: a guess there would waste every drafted token
after it. Where the answer has begun a
rule's output (the target wrote the `\\n ` of a line break itself), the copy writes the rest of it and
goes on (`partial`), instead of losing the copy to a lookup of the tail.

Rules are learned from this generation only (never from another request), and proposals stay point
masses that the verifier checks like any copy: exactness is untouched.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_GAP = 8  # longest rewrite learned, on either side (tokens)
MIN_MATCH = 2  # tokens copied again after a rewrite that end it (one is too often chance)


@dataclass
class Rule:
    src: tuple[int, ...]  # prompt tokens (non-empty)
    out: tuple[int, ...]  # what the answer wrote in their place (may be empty)
    hits: int = 0  # times the answer wrote it (learned, or proposed and kept)
    misses: int = 0  # times a proposal of it was not kept
    by_left: dict[int, int] = field(default_factory=dict)  # kept - not kept, after each prompt token seen before it
    last: dict[int, bool] = field(default_factory=dict)  # after each such token: whether it was kept the last time
    written: int = 0  # times the answer wrote it, proposed or not

    def trusted(self, left: int) -> bool:
        """Whether to write it after prompt token `left`: as it went after that token; after a token not
        seen before it, where it was kept after two others (a rename, not a format's one place) and
        kept more often than not overall."""
        if left in self.by_left:
            return self.by_left[left] > 0
        return sum(n > 0 for n in self.by_left.values()) >= 2 and self.hits > self.misses

    def doubtful(self, left: int) -> bool:
        """Whether a copy should stop before it after `left` and leave it to the target: the last time
        after `left` went against what its count says (`trusted`: the answer has changed its way there,
        an inline list in a file whose other commas break lines), or `left` is new and the rule is not
        trusted there though the answer wrote it at least twice (copying its input as it is would be a
        guess too; a rule learned by one chance rewrite stops no copy)."""
        if left not in self.last:
            return not self.trusted(left) and self.written >= 2
        return self.last[left] != (self.by_left[left] > 0)

    def count(self, left: int, hit: bool, proposed: bool = True) -> None:
        """An outcome after prompt token `left`: the answer kept the rule's output (`hit`) or copied its
        input as it is; `proposed`: a proposal of it was judged (else the answer chose unprompted)."""
        if proposed:
            self.hits, self.misses = self.hits + hit, self.misses + (not hit)
        self.by_left[left] = self.by_left.get(left, 0) + (1 if hit else -1)
        self.last[left], self.written = hit, self.written + hit


@dataclass
class Rewrites:
    """The rules of one generation and its copy alignment. `start(prompt_len)` begins a generation."""

    prompt_len: int = 0
    rules: dict[int, list[Rule]] = field(default_factory=dict)  # by the first prompt token they rewrite
    aligned: tuple[int, int] | None = None  # (context position, the prompt position it copies)
    run: int = 0  # tokens aligned since the copy was last lost (a match length for auto γ's pricing)
    partial: tuple[Rule, int] | None = None  # a rule whose output the answer has begun after `aligned`, and how much
    _pending: tuple[int, list[Span], list[int]] | None = None  # (at, spans, tokens)
    _judged: set[tuple[int, int]] = field(default_factory=set)  # (prompt position, id of a rule) counted there

    def start(self, prompt_len: int) -> None:
        self.prompt_len, self.rules, self.aligned, self.run = prompt_len, {}, None, 0
        self.partial = self._pending = None
        self._judged = set()

    def track(self, context: list[int]) -> None:
        """Score the last proposal's rules by what was committed, then walk the alignment on: over copied
        tokens (where a rule's input is copied as it is, the rule declined after the token before it),
        known rewrites, and a new rewrite where the answer copies the prompt again after it."""
        if self._pending is not None:
            self._score(context)
        self.partial = None
        if self.aligned is None:
            return
        a, q = self.aligned
        while a + 1 < len(context):
            if q + 1 < self.prompt_len and context[q + 1] == context[a + 1]:
                self._decline(context, q + 1, a + 1)
                a, q = a + 1, q + 1
                self.run += 1
                continue
            rule = self._applies(context, q + 1, context, a + 1)
            if rule is not None:
                self._judge(rule, context, q + 1, True, proposed=False)
            else:
                rule = self._resync(context, a, q)
            if rule is None:
                break
            a, q = a + len(rule.out), q + len(rule.src)
            self.run += len(rule.out)
        lost = len(context) - 1 - a > MAX_GAP + MIN_MATCH  # the answer went elsewhere: a lookup re-anchors
        self.aligned = None if lost else (a, q)
        if not lost and a + 1 < len(context):
            self.partial = self._begun(context, a, q)
            if self.partial is not None:  # the target chose it: the copy writes only the rest
                self._judge(self.partial[0], context, q + 1, True, proposed=False)

    def _judge(self, rule: Rule, context: list[int], c: int, hit: bool, proposed: bool) -> None:
        """Count an outcome of `rule` at prompt position c, once per position."""
        if (c, id(rule)) not in self._judged:
            self._judged.add((c, id(rule)))
            rule.count(context[c - 1], hit, proposed)

    def _decline(self, context: list[int], c: int, o: int) -> None:
        """The answer (from context[o] on) copied the prompt from position c as it is: each rule of that
        input whose output it did not write is declined after the prompt token before c."""
        for rule in self._inputs_at(context, c):
            n, wrote = len(rule.src), tuple(context[o:o + len(rule.out)])
            if o + n <= len(context) and tuple(context[o:o + n]) == rule.src and wrote != rule.out[:len(wrote)]:
                self._judge(rule, context, c, False, proposed=False)

    def _begun(self, context: list[int], a: int, q: int) -> tuple[Rule, int] | None:
        """The longest rule of prompt position q+1 whose output the answer's tail (after a) begins,
        trusted or not: the answer has begun it."""
        tail = tuple(context[a + 1:])
        rule = _longest(r for r in self._inputs_at(context, q + 1)
                        if len(r.out) > len(tail) and r.out[:len(tail)] == tail)
        return None if rule is None else (rule, len(tail))

    def _inputs_at(self, context: list[int], c: int) -> list[Rule]:
        """The rules whose input the prompt holds from position c on."""
        if not 0 < c < self.prompt_len:
            return []
        return [rule for rule in self.rules.get(context[c], ())
                if c + len(rule.src) <= self.prompt_len and tuple(context[c:c + len(rule.src)]) == rule.src]

    def _resync(self, context: list[int], a: int, q: int) -> Rule | None:
        """Where the answer (after position a) copies the prompt again (after prompt position q) for
        MIN_MATCH tokens, within MAX_GAP tokens on either side: the rewrite between, learned (the
        smallest gaps first; an insertion as a rewrite of the prompt token it went before). None while
        the answer has not written enough to tell."""
        starts: dict[tuple[int, ...], int] = {}  # the prompt's MIN_MATCH-grams after q, by their first position
        for s in range(min(q + 1 + MAX_GAP, self.prompt_len - MIN_MATCH), q, -1):
            starts[tuple(context[s:s + MIN_MATCH])] = s
        best = None  # (i + j, i, j)
        for i in range(min(MAX_GAP, len(context) - MIN_MATCH - a - 1) + 1):
            s = starts.get(tuple(context[a + 1 + i:a + 1 + i + MIN_MATCH]))
            if s is not None and (i or s > q + 1) and (best is None or i + s - q - 1 < best[0]):
                best = (i + s - q - 1, i, s - q - 1)
        if best is None:
            return None
        _, i, j = best
        o, s = a + 1 + i, q + 1 + j
        if j == 0:  # nothing of the prompt left out: the insertion goes with the next prompt token
            o, s = o + 1, s + 1
        return self._learn(context, q + 1, tuple(context[q + 1:s]), tuple(context[a + 1:o]))

    def anchor(self, context: list[int], at: int, length: int) -> None:
        """A lookup found the context's last `length` tokens copying the prompt up to position `at`
        (exclusive): the alignment starts there where it was lost (or never found), or where it does
        not reach the tail and this match is no chance (MIN_MATCH tokens)."""
        if at > self.prompt_len or (self.aligned is not None and
                                    (self._reaches_tail(context) or length < MIN_MATCH)):
            return
        self.aligned, self.run, self.partial = (len(context) - 1, at - 1), length, None

    def _reaches_tail(self, context: list[int]) -> bool:
        """Whether the alignment accounts for the whole context: up to its last token, or up to a rule
        output the tail has begun."""
        return self.aligned[0] + (self.partial[1] if self.partial else 0) == len(context) - 1

    def at_tail(self, context: list[int]) -> int | None:
        """The prompt position the answer's copy continues from, where the alignment reaches the tail."""
        if self.aligned is None or not self._reaches_tail(context) or self.aligned[1] + 1 >= self.prompt_len:
            return None
        return self.aligned[1] + 1

    def follow(self, context: list[int], at: int, k: int) -> list[int]:
        """Up to k tokens copied from context position `at` on, each trusted rule's output written in place
        of its prompt tokens (inside the prompt only; at `at`, the rest of a rule output the tail has
        begun); remembered, to score the rules by what is kept."""
        out: list[int] = []
        spans: list[Span] = []
        c = at
        if self.partial is not None and self.at_tail(context) == at:
            rule, written = self.partial
            out.extend(rule.out[written:])
            c += len(rule.src)
        while len(out) < k and c < len(context):
            if c < self.prompt_len and self._doubtful(context, c):
                break  # the target's next token settles it: a guess here would waste the rest
            rule = self._applies(context, c, None, 0) if c < self.prompt_len else None
            if rule is not None:
                spans.append(Span(rule, c, len(out), len(out) + len(rule.out)))
                out.extend(rule.out)
                c += len(rule.src)
            else:
                out.append(context[c])
                c += 1
        out = out[:k]
        self._pending = (len(context), spans, out) if spans else None
        return out

    def _doubtful(self, context: list[int], c: int) -> bool:
        """Whether a rule of prompt position c is `doubtful` after the token before c: the copy stops there."""
        return any(rule.doubtful(context[c - 1]) for rule in self._inputs_at(context, c))

    def _applies(self, context: list[int], c: int, answer: list[int] | None, o: int) -> Rule | None:
        """The longest trusted rule whose prompt side starts at context[c] (and, given `answer`, whose
        output is what the answer wrote from answer[o] on)."""
        return _longest(rule for rule in self._inputs_at(context, c) if rule.trusted(context[c - 1])
                        and (answer is None or (rule.out and tuple(answer[o:o + len(rule.out)]) == rule.out)))

    def _learn(self, context: list[int], c: int, src: tuple[int, ...], out: tuple[int, ...]) -> Rule:
        """The answer wrote `out` for the prompt's `src` at position c: a new rule, or a hit of a known one."""
        rules = self.rules.setdefault(src[0], [])
        rule = next((r for r in rules if r.src == src and r.out == out), None)
        if rule is None:
            rules.append(rule := Rule(src, out))
        self._judge(rule, context, c, True, proposed=True)
        return rule

    def _score(self, context: list[int]) -> None:
        """Each rule the last proposal wrote: a hit if the committed tokens kept its output whole, a
        miss if they left it inside; unknown if the proposal was cut before it."""
        if self._pending is None:
            return
        at, spans, proposed = self._pending
        self._pending = None
        committed = context[at:at + len(proposed)]
        kept = next((i for i, (p, c) in enumerate(zip(proposed, committed)) if p != c), len(committed))
        for span in spans:
            if kept >= span.end or (kept < len(committed) and span.begin <= kept):  # else cut before it: unknown
                self._judge(span.rule, context, span.at, kept >= span.end, proposed=True)


def _longest(rules: Iterable[Rule]) -> Rule | None:
    """The rule of the longest input among `rules` (the first such), or None."""
    return max(rules, key=lambda rule: len(rule.src), default=None)


@dataclass
class Span:
    """A rule a proposal wrote for the prompt from position `at`, as proposal[begin:end]."""

    rule: Rule
    at: int
    begin: int
    end: int
