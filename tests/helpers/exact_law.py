"""The exact law of the decode loop's output, by enumerating its random numbers instead of sampling them.

Every random number the loop uses is a uniform in [0, 1) drawn through ONE seam,
`speculative.sampling.draw_uniforms` (the verifier's, through `Uniforms`; the sampling drafters', through
`sampling.sample`). `enumerated()` replaces it: each uniform becomes a symbolic `Uniform`, an interval
[lo, hi) that starts as [0, 1). The code under test then uses it in only two ways, and each is tracked:

* a comparison `u * c < t` (the verifier's accept test `u·L·q(x) < p(x)`): the interval is split at
  t / c and the run follows one side (a *choice point*);
* an inverse-CDF draw `sample_from_uniform(probs, u)` (drafts, residual, bonus, the coupled rule): the
  interval is split at the CDF's breakpoints cdf_i / total, the run follows one cell, and the REAL
  `sample_from_uniform` is then called with a point inside that cell (its answer must be that cell's
  token: a check that the enumerator reads the function as it is).

Any other use (`float(u)`, arithmetic other than a non-negative scale) raises, so no use of randomness
escapes the enumeration. `enumerate_law(run)` re-runs `run` from scratch once per path, depth first
(an odometer over the choice points: re-running is deterministic, so replaying the choices taken so
far reaches the same choice points, which is checked), and adds each path's measure -- the product of
the final widths of its uniforms -- to the outcome it returned. The result is the loop's exact output
law (in real arithmetic over the code's float32 laws), without sampling noise.

The semantics are those of real arithmetic: the code's `float32(u·q) < p` is read as u < p/q. A
cell narrower than float precision is still given its width.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from exactspec.speculative import sampling
from exactspec.speculative import verify as verify_module
from exactspec.speculative.sampling import SamplingParams, warp

REAL_SAMPLE_FROM_UNIFORM = sampling.sample_from_uniform


class UntrackedUse(TypeError):
    """A uniform was used in a way the enumerator does not follow (it must not be read as a float)."""


class Uniform:
    """One symbolic uniform: the interval [lo, hi) of values consistent with the path taken so far."""

    __slots__ = ("enum", "lo", "hi")

    def __init__(self, enum: "Enumerator") -> None:
        self.enum, self.lo, self.hi = enum, 0.0, 1.0

    def __mul__(self, c) -> "Scaled":
        return Scaled(self, 1.0) * c

    __rmul__ = __mul__

    def __lt__(self, t) -> bool:
        return Scaled(self, 1.0) < t

    def __le__(self, t) -> bool:
        return Scaled(self, 1.0) <= t

    def __gt__(self, t) -> bool:
        return Scaled(self, 1.0) > t

    def __ge__(self, t) -> bool:
        return Scaled(self, 1.0) >= t

    def __float__(self):
        raise UntrackedUse("a uniform was read as a float: the enumerator cannot follow it")

    __int__ = __float__

    def split(self, cuts: list[float]) -> int:
        """Follow one cell of [lo, hi) cut at `cuts` (sorted, in (lo, hi)) -> the cell's index; narrows."""
        edges = [self.lo, *cuts, self.hi]
        i = self.enum.choose(len(edges) - 1)
        self.lo, self.hi = edges[i], edges[i + 1]
        return i


class Scaled:
    """u · c (c >= 0): what the verifier's accept test compares."""

    __slots__ = ("u", "c")

    def __init__(self, u: Uniform, c: float) -> None:
        self.u, self.c = u, c

    def __mul__(self, c) -> "Scaled":
        c = float(c)
        if not (c >= 0 and math.isfinite(c)):
            raise UntrackedUse(f"a uniform scaled by {c}")
        return Scaled(self.u, self.c * c)

    __rmul__ = __mul__

    def _below(self, t) -> bool:
        """u · c < t, following the interval (one choice point where t / c cuts it)."""
        t = float(t)
        if self.c == 0:
            return 0.0 < t
        cut = t / self.c
        if cut <= self.u.lo:
            return False
        if cut >= self.u.hi:
            return True
        return self.u.split([cut]) == 0

    def __lt__(self, t) -> bool:
        return self._below(t)

    __le__ = __lt__  # equality has measure 0

    def __gt__(self, t) -> bool:
        return not self._below(t)

    __ge__ = __gt__

    def __float__(self):
        raise UntrackedUse("a scaled uniform was read as a float")

    __bool__ = __float__


def tracked_sample_from_uniform(probs, uniform) -> int:
    """`sampling.sample_from_uniform` for a symbolic uniform. The real function is an inverse CDF: as u
    moves it changes its answer only where u·total crosses a partial sum, i.e. at cdf_i / total. So the
    interval is cut there, one choice per cell, and each cell's token is what the REAL function answers at
    a point inside it (adjacent cells with one answer are merged). For a law (non-negative entries) that
    answer must be the cell's own token, which is checked."""
    if not isinstance(uniform, Uniform):
        if isinstance(uniform, Scaled):
            raise UntrackedUse("inverse CDF with a scaled uniform")
        return REAL_SAMPLE_FROM_UNIFORM(probs, uniform)
    p = np.asarray(sampling.as_numpy(probs), dtype=np.float64)
    cdf = np.cumsum(p)
    total = cdf[-1]
    if not total > 0:
        return REAL_SAMPLE_FROM_UNIFORM(probs, 0.5)  # raises as the real one does
    edges = sorted({uniform.lo, uniform.hi, *(b for b in (cdf / total).tolist() if uniform.lo < b < uniform.hi)})
    cells = []  # (lo, hi, token), merged where the real function answers the same
    for lo, hi in zip(edges, edges[1:]):
        token = REAL_SAMPLE_FROM_UNIFORM(probs, 0.5 * (lo + hi))
        if cells and cells[-1][2] == token:
            cells[-1] = (cells[-1][0], hi, token)
        else:
            cells.append((lo, hi, token))
    if (p >= 0).all():
        for lo, hi, token in cells:
            assert cdf[token] - p[token] <= lo * total * (1 + 1e-12) and hi * total <= cdf[token] * (1 + 1e-12), \
                f"the enumerator's cell [{lo}, {hi}) disagrees with sample_from_uniform's token {token}"
    i = uniform.split([lo for lo, _, _ in cells[1:]]) if len(cells) > 1 else 0
    return cells[i][2]


class Enumerator:
    """Depth-first over the choice points of a deterministic run: `script` holds the cell taken at each."""

    def __init__(self) -> None:
        self.script: list[int] = []
        self.widths: list[int] = []  # options at each choice point of the current path
        self.pos = 0
        self.uniforms: list[Uniform] = []
        self.runs = 0

    def fresh(self, n: int) -> list[Uniform]:
        out = [Uniform(self) for _ in range(n)]
        self.uniforms += out
        return out

    def choose(self, options: int) -> int:
        if self.pos < len(self.script):
            if self.widths[self.pos] != options:
                raise AssertionError("the run is not deterministic: a replayed choice point changed")
            i = self.script[self.pos]
        else:
            self.script.append(0)
            self.widths.append(options)
            i = 0
        self.pos += 1
        return i

    def paths(self, run: Callable[[], Hashable]) -> Iterator[tuple[float, Hashable]]:
        """(measure, outcome) of every path of `run`."""
        while True:
            self.pos, self.uniforms = 0, []
            outcome = run()
            self.runs += 1
            if self.pos != len(self.script):
                raise AssertionError("the run is not deterministic: it ended before its replayed choices")
            yield math.prod(u.hi - u.lo for u in self.uniforms), outcome
            while self.script and self.script[-1] + 1 >= self.widths[-1]:
                self.script.pop()
                self.widths.pop()
            if not self.script:
                return
            self.script[-1] += 1


@contextmanager
def enumerated(enum: Enumerator) -> Iterator[Enumerator]:
    """Draw the loop's uniforms from `enum` (and track the inverse-CDF draws) inside the block."""
    saved = sampling.draw_uniforms, sampling.sample_from_uniform, verify_module.sample_from_uniform
    sampling.draw_uniforms = lambda n, generator=None: enum.fresh(n)
    sampling.sample_from_uniform = verify_module.sample_from_uniform = tracked_sample_from_uniform
    try:
        yield enum
    finally:
        sampling.draw_uniforms, sampling.sample_from_uniform, verify_module.sample_from_uniform = saved


def enumerate_law(run: Callable[[], Hashable]) -> tuple[dict[Hashable, float], int]:
    """The exact law of `run()`'s outcome (its random numbers drawn through the seam) -> (law, paths)."""
    enum = Enumerator()
    law: dict[Hashable, float] = defaultdict(float)
    with enumerated(enum):
        for measure, outcome in enum.paths(run):
            law[outcome] += measure
    return dict(law), enum.runs


# --- a deterministic target ----------------------------------------------------------------------

class TableLM:
    """A causal LM whose next-token logits are a fixed pseudo-random function of the WHOLE prefix (a
    table filled on demand: standard normals × `sharpness`, seeded by (seed, prefix)). It implements the
    batched adapter interface (speculative/interfaces.py: a per-row token list is its "KV cache"), so the
    real loop drives it like fast_llama. Why not a tiny Llama: the enumeration re-runs the loop once per
    path (thousands of runs per law), and a table answers in microseconds; its logits are also the same
    bits whatever the batch shape, so the loop's warped laws equal the oracle's to the last bit."""

    batched = True

    def __init__(self, seed: int, vocab: int, sharpness: float = 1.5, max_length: int = 64,
                 eos_token_ids: set[int] | None = None, bias: dict[int, float] | None = None) -> None:
        self.seed, self.vocab_size, self.sharpness, self.max_length = seed, vocab, sharpness, max_length
        self.eos_token_ids = set(eos_token_ids or ())
        self.bias = bias or {}
        self.table: dict[tuple[int, ...], torch.Tensor] = {}
        self.rows: list[list[int]] = [[]]

    def logits(self, prefix) -> torch.Tensor:
        """[V] float32 logits of the token after `prefix`."""
        key = tuple(int(t) for t in prefix)
        got = self.table.get(key)
        if got is None:
            rng = np.random.default_rng([self.seed, len(key), *key])
            x = rng.standard_normal(self.vocab_size) * self.sharpness
            for t, b in self.bias.items():
                x[t] += b
            got = self.table[key] = torch.tensor(x, dtype=torch.float32)
        return got

    # --- one-row methods (a draft model's) ---
    @property
    def length(self) -> int:
        return len(self.rows[0])

    def reset(self, batch: int = 1) -> None:
        self.rows = [[] for _ in range(batch)]

    def forward(self, new_ids: torch.Tensor) -> torch.Tensor:
        return self.forward_rows(new_ids)

    def prefill(self, new_ids: torch.Tensor) -> None:
        self.forward_rows(new_ids, logits=False)

    def truncate(self, length: int) -> None:
        self.rows[0] = self.rows[0][:length]

    # --- batch methods ---
    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def forward_rows(self, new_ids: torch.Tensor, logits: bool = True) -> torch.Tensor | None:
        ids = new_ids.tolist()
        assert len(ids) == len(self.rows), f"{len(ids)} rows fed to a cache of {len(self.rows)}"
        out = []
        for row, new in zip(self.rows, ids):
            found = []
            for t in new:
                row.append(t)
                if logits:
                    found.append(self.logits(row))
            if logits:
                out.append(torch.stack(found))
        return torch.stack(out) if logits else None

    def truncate_rows(self, lengths) -> None:
        for row, n in zip(self.rows, [int(n) for n in lengths]):
            del row[n:]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.rows = [list(self.rows[int(j)]) for j in rows]

    def append_rows(self, prompt_ids: list[int], copies: int = 1) -> int:
        self.rows += [list(prompt_ids[:-1]) for _ in range(copies)]
        return 0

    def save_cache(self):
        return [list(r) for r in self.rows]

    def restore_cache(self, saved) -> None:
        self.rows = [list(r) for r in saved]


# --- the oracle: the target's own law, enumerated --------------------------------------------------

def target_law(lm: TableLM, prompt: list[int], n: int,
               law_at: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None,
               params: SamplingParams | None = None) -> dict[tuple[int, ...], float]:
    """The law of the next n tokens: the product along each sequence of its next-token laws
    (`law_at(logits, generated so far)` -> probs [V], default: warp(logits, params)), each normalised in
    float64 (the sampler normalises the float32 law by its float64 sum). Stops at EOS like the loop."""
    law_at = law_at or (lambda logits, generated: warp(logits[None], params)[0])
    out: dict[tuple[int, ...], float] = {}

    def walk(seq: tuple[int, ...], prob: float) -> None:
        if len(seq) == n or (seq and seq[-1] in lm.eos_token_ids):
            out[seq] = out.get(seq, 0.0) + prob
            return
        p = law_at(lm.logits(prompt + list(seq)), list(seq)).double().numpy()
        p = p / p.sum()
        for t in np.flatnonzero(p > 0):
            walk(seq + (int(t),), prob * float(p[t]))

    walk((), 1.0)
    return out


def distance(a: dict, b: dict) -> float:
    """max |a(x) - b(x)| over every outcome of either law."""
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def product(*laws: dict) -> dict:
    """The joint law of independent outcomes."""
    out = {}
    for parts in itertools.product(*(law.items() for law in laws)):
        out[tuple(k for k, _ in parts)] = math.prod(v for _, v in parts)
    return out


def batch_run(target, specs: list[tuple], n: int) -> Callable[[], tuple]:
    """A `run` for `enumerate_law`: rows (prompt, make_drafter, params, gamma) decoded as ONE batch of the
    real loop for n tokens each -> their outputs, in row order."""
    from exactspec.speculative.fixed_gamma import as_policy
    from exactspec.speculative.loop import decode_rows
    from exactspec.speculative.rows import Row

    def run() -> tuple:
        rows = [Row(j, prompt, make(), params, as_policy(gamma), n, None) for j, (prompt, make, params, gamma) in enumerate(specs)]
        out = {j: [] for j in range(len(rows))}
        for row, tokens in decode_rows(target, rows):
            out[row.key] += tokens
        return tuple(tuple(out[j]) for j in range(len(rows)))

    return run
