"""TILED PREFILL's plan (models/llamacpp/prefill_plan.py), without a model: which positions of a prompt are
computed by which attention kernel, how a prefill is cut into passes and chunks, and how much of a cached
prefix a new prompt may keep."""

from __future__ import annotations

import random

from exactspec.models.llamacpp.prefill_plan import ROW, TILED, chunk, kinds, pieces, reusable, turns

TILE = 64
MARK = [1, 5, 6]  # "<|im_start|>assistant\n"
END = {2}  # "<|im_end|>"


def chat(*turn_lengths: int) -> list[int]:
    """A conversation: user turns of the given lengths (even places) and answers (odd places), each
    answer after the marker and ended by the end token; a generation prompt (the marker) last."""
    ids: list[int] = []
    for i, n in enumerate(turn_lengths):
        ids += MARK + [9] * n + [2] if i % 2 else [7] * n + [2]
    return ids + MARK


def test_assistant_turns_run_from_the_marker_through_the_end_token():
    ids = chat(100, 20, 30)
    assert turns(ids, MARK, END) == [(101, 125), (156, 159)]
    assert turns(ids[:-1], MARK, END) == [(101, 125), (156, 158)]  # a prompt's last token is decoded: a marker's prefix counts
    assert turns(ids[:-2], MARK, END)[-1] == (156, 157)
    assert turns(ids, [], END) == []  # no chat template: no turns
    assert turns([1, 5, 7, 1, 5, 6, 9, 2], MARK, END) == [(3, 8)]  # a marker's first token alone is not one


def test_runs_of_a_tile_or_more_are_tiled_the_rest_per_row():
    ids = chat(100, 20, 30)  # user 0-100, answer 101-124, user 125-155, marker 156-158
    plan = kinds(ids, MARK, END, TILE)
    assert plan[:101] == bytes([TILED]) * 101
    assert plan[101:] == bytes([ROW]) * (len(ids) - 101)  # the answer, and the 31-token user turn after it
    assert kinds([7] * 63, MARK, END, TILE) == bytes(63)
    assert kinds([7] * 64, MARK, END, TILE) == bytes([TILED]) * 64


def test_an_agents_next_prompt_plans_its_previous_answer_as_decoding_computed_it():
    """The cells a step's prompt and its answer wrote (the prompt by its plan, the answer per-row) are
    what the next prompt's plan computes: all of them are reusable."""
    first = chat(300)[:-1]  # prefilled: the prompt but its last token
    cached = kinds(first, MARK, END, TILE) + bytes([ROW]) * 41  # its last token and 40 answer tokens, decoded
    following = chat(300, 40, 200)[:-1]
    assert reusable(cached, kinds(following, MARK, END, TILE), len(cached), TILE) == len(cached)


def test_reuse_stops_where_kinds_differ_or_too_little_of_a_tiled_run_is_left():
    plan = kinds([7] * 300, MARK, END, TILE)  # one tiled run
    assert reusable(plan, plan, 300, TILE) == 300  # nothing left to compute
    assert reusable(plan, plan, 200, TILE) == 200
    assert reusable(plan, plan, 260, TILE) == 300 - TILE  # 40 left: the run's last tile is computed again
    assert reusable(bytes([TILED]) * 100 + bytes(50), plan, 150, TILE) == 100  # kinds differ from 100 on
    short = kinds([7] * 40, MARK, END, TILE)  # per-row: a prompt too short to tile
    assert reusable(short, plan, 40, TILE) == 0
    assert reusable(plan[:200], bytes(250), 200, TILE) == 0


def test_passes_keep_each_kind_and_whole_tiles():
    plan = bytes([TILED]) * 1000 + bytes([ROW]) * 130 + bytes([TILED]) * 520
    assert pieces(plan, 512, TILE) == [(512, TILED), (488, TILED), (63, ROW), (63, ROW), (4, ROW),
                                       (448, TILED), (72, TILED)]  # the last pass takes a whole tile
    assert pieces(bytes([TILED]) * 40, 512, TILE) == [(40, ROW)]  # too short for the tiled kernel
    assert pieces(b"", 512, TILE) == []


def test_chunks_never_leave_a_tiled_run_a_pass_too_short_to_tile():
    rng = random.Random(0)
    for _ in range(300):
        plan = bytearray()
        while len(plan) < 600:
            plan += bytes([rng.choice((ROW, TILED))]) * (rng.randrange(1, 63) if rng.random() < .5 else rng.randrange(64, 300))
        plan = kinds([7 if k else 9 for k in plan], [9], {9}, TILE)  # a valid plan (tiled runs of 64+)
        rest = bytes(plan)
        while rest:
            take = chunk(rest, rng.randrange(1, 200), TILE)
            assert 0 < take <= len(rest)
            for part in (rest[:take], rest[take:]):  # each side's tiled runs at its edges still tile
                for n, kind in pieces(part, 512, TILE):
                    assert n >= TILE if kind == TILED else n < TILE
            assert [k for n, k in pieces(rest[:take], 512, TILE) for _ in range(n)] == list(rest[:take])
            rest = rest[take:]
