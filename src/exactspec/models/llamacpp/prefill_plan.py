"""TILED PREFILL's plan: which attention kernel computes each prompt position, a pure function of its tokens.

ggml's CPU flash attention gives a pass of 64+ query rows (a tile) its tiled kernel and smaller passes
(one-token steps, verification blocks) its per-row kernel, which sums in another order. Within either
kernel a row's result does not depend on the rows beside it nor on where the tiles start (the self-test
checks a prefill split off a tile boundary), so a position's KV depends only on its KIND -- TILED or ROW
-- and on the cells before it. Decoding writes ROW cells. So that a later prompt may reuse an answer's
cells (an agent re-sends its conversation every step), each assistant turn -- from the chat template's
generation marker (ChatML's `<|im_start|>assistant\\n`) through its end-of-turn token -- is ROW in every
prompt, as are runs of other positions shorter than a tile (they cannot fill a tiled pass); runs of a
tile or more are TILED. A prefill, cold, after a cached prefix or in chunks, computes each position with
its kind, so it writes what a cold prefill writes; a cached prefix is reused as far as the kinds it was
computed with match the new prompt's (`reusable`).
"""

from __future__ import annotations

ROW, TILED = 0, 1


def turns(ids: list[int], marker: list[int], ends: set[int]) -> list[tuple[int, int]]:
    """[start, end) of each assistant turn in `ids`: a `marker` (or a prefix of one ending `ids`: a
    prompt's last token is decoded, not prefilled) through the next token in `ends`, or to the end."""
    if not marker:
        return []
    found, p, n, m = [], 0, len(ids), len(marker)
    while True:
        try:
            s = ids.index(marker[0], p)
        except ValueError:
            return found
        if ids[s:s + m] != marker[:n - s]:
            p = s + 1
            continue
        e = next((i for i in range(s + m, n) if ids[i] in ends), n - 1) + 1
        found.append((s, e))
        p = e


def kinds(ids: list[int], marker: list[int], ends: set[int], tile: int) -> bytearray:
    """The kind (ROW 0, TILED 1) of each position of a prefill of `ids`: ROW in assistant turns and in
    runs shorter than `tile` between them, TILED elsewhere."""
    out, start = bytearray(len(ids)), 0
    for s, e in turns(ids, marker, ends) + [(len(ids), len(ids))]:
        if s - start >= tile:
            out[start:s] = b"\x01" * (s - start)
        start = e
    return out


def _split(n: int, size: int) -> list[int]:
    return [min(size, n - start) for start in range(0, n, size)]


def pieces(plan: bytes, cap: int, tile: int) -> list[tuple[int, int]]:
    """The passes that compute positions of kinds `plan` in order -> [(positions, kind)]: a TILED run in
    passes of at most `cap` (a multiple of `tile`, 2 tiles or more) and at least `tile` rows, whole tiles
    but the last; a ROW run, and a TILED one shorter than a tile (a prefill that does not start where a
    prompt's plan allows: it computes what decoding would), in passes of at most tile - 1."""
    out, i = [], 0
    while i < len(plan):
        kind = plan[i]
        j = plan.find(b"\x00" if kind else b"\x01", i)
        j = len(plan) if j < 0 else j
        if kind == TILED and j - i >= tile:
            sizes = _split(j - i, cap)
            if sizes[-1] < tile:  # the last pass takes the previous one's last tile
                sizes[-2:] = [sizes[-2] - tile, sizes[-1] + tile]
            out += [(n, TILED) for n in sizes]
        else:
            out += [(n, ROW) for n in _split(j - i, tile - 1)]
        i = j
    return out


def reusable(cached: bytes, plan: bytes, common: int, tile: int) -> int:
    """How many of `common` cached positions (computed with kinds `cached`) a prefill planned as `plan`
    may keep: up to the first position whose kind differs, and not so far into a TILED run that less
    than a tile of it is left to compute."""
    r = next((i for i in range(min(common, len(cached), len(plan))) if cached[i] != plan[i]), min(common, len(cached), len(plan)))
    if r < len(plan) and plan[r] == TILED:
        end = plan.find(b"\x00", r)
        end = len(plan) if end < 0 else end
        if end - r < tile:
            r = end - tile  # the run is a tile or more: this is within it
    return r


def chunk(plan: bytes, want: int, tile: int) -> int:
    """How many of the positions planned as `plan` a chunked prefill computes now, about `want`: a cut
    inside a TILED run leaves whole tiles before it and a tile or more after it (or takes the run's rest)."""
    if want >= len(plan):
        return len(plan)
    take = max(1, want)
    if plan[take - 1] == TILED and plan[take] == TILED:
        start = plan.rfind(b"\x00", 0, take) + 1
        end = plan.find(b"\x00", take)
        end = len(plan) if end < 0 else end
        take = start + max(tile, (take - start) // tile * tile)
        if end - take < tile:
            take = end
    return take
