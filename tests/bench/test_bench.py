"""The side-by-side bench's constrained workload (`json`): shipped cases with schemas, the rows it adds
(unconstrained plain, forced-only speculation), greedy identity across its constrained rows, and the
forced / schema-valid shares it reports; token vs block verification rows side by side."""

from __future__ import annotations

import argparse

import pytest

from exactspec.bench.cli import add_bench_subcommand
from exactspec.bench.runner import build_methods, methods_for, run_bench, to_markdown
from exactspec.bench.workloads import WORKLOADS, load_cases, load_workload, schema_valid
from exactspec.errors import ExactSpecError
from exactspec.speculative.grammar import grammar_from_spec
from exactspec.speculative.sampling import SamplingParams


def test_json_workload_is_shipped_data():
    cases = load_cases("json")
    assert "json" in WORKLOADS and len(cases) >= 6
    for case in cases:
        assert case.prompt and grammar_from_spec(case.response_format)  # strict schemas llguidance compiles
    assert load_workload("json") == [c.prompt for c in cases] and all(c.max_new_tokens for c in cases)
    assert all(c.response_format is None for c in load_cases("grounded"))
    schema = cases[0].response_format
    assert not schema_valid('{"name": "x"}', schema) and not schema_valid("not json", schema)


def test_constrained_rows_decode_the_same_tokens(embedded, embedded_llamacpp):
    """The json workload's rows: HF generate (no grammar) is not run on it; the constrained rows, decoded
    on llama.cpp (the CPU default backend), give the same tokens."""
    with_hf = build_methods(embedded, ["prompt-lookup"], [4], auto=False, hf=True, constrained=True)
    assert [m.method for m in methods_for(with_hf, constrained=True)] == [
        "exactspec-plain", "exactspec-plain-unconstrained", "exactspec-spec", "exactspec-spec"]
    assert "exactspec-plain-unconstrained" not in [m.method for m in methods_for(with_hf, constrained=False)]
    engine = embedded_llamacpp
    methods = build_methods(engine, ["prompt-lookup"], [4], auto=False, hf=False, constrained=True,
                            backend="llama.cpp")
    on_json = methods_for(methods, constrained=True)
    assert [(m.method, m.drafter) for m in on_json] == [
        ("exactspec-plain", None), ("exactspec-plain-unconstrained", None), ("exactspec-spec", "none"),
        ("exactspec-spec", "prompt-lookup")]
    case = load_cases("json")[2]  # a tool call: many forced tokens, values copied from the prompt
    ids = engine.encode(case.prompt)
    greedy = SamplingParams(temperature=0)
    out = {(m.method, m.drafter): m.run(ids, greedy, 90, 0, case.response_format) for m in on_json}
    constrained = [v for k, v in out.items() if k[0] != "exactspec-plain-unconstrained"]
    assert all(o[0] == constrained[0][0] for o in constrained)  # greedy identity under the grammar
    assert schema_valid(engine.tokenizer.decode(constrained[0][0], skip_special_tokens=True), case.response_format)
    forced_only = out[("exactspec-spec", "none")][2]
    assert forced_only.forced_accepted > 10 and forced_only.tokens_per_target_call > 1.2


def test_json_rows(embedded_llamacpp):
    """The json workload at each case's own budget (how long a CPU's greedy answer is never decides the
    test: an output cut at the budget is counted in cut_share, not judged invalid)."""
    engine = embedded_llamacpp
    methods = build_methods(engine, [], [4], auto=False, hf=False, constrained=True, backend="llama.cpp")
    rows = run_bench(engine, methods, ["json"], [0.0], prompts_per_workload=1, reps=1, max_new_tokens=None)
    by = {(r["method"], r["drafter"]): r for r in rows}
    plain, free, forced = by[("exactspec-plain", None)], by[("exactspec-plain-unconstrained", None)], \
        by[("exactspec-spec", "none")]
    assert plain["constrained"] and not free["constrained"] and plain["valid_share"] == 1.0 == forced["valid_share"]
    assert plain["cut_share"] == 0 and free["cut_share"] is None
    assert free["valid_share"] is None and plain["forced_share"] == 0 and forced["forced_share"] > 0.1
    assert forced["speedup_vs_plain"] > 0 and forced["tokens_per_target_call"] > 1
    assert plain["decode_ms_per_token"] > 0 and free["decode_ms_per_token"] > 0
    table = to_markdown(rows)
    assert "schema-valid" in table and "forced share" in table


def test_batch_bench_rows(embedded):
    """`bench --batch`: the four methods per batch size, with the fields the table prints."""
    from exactspec.bench.runner import batch_table, run_batch_bench

    rows = run_batch_bench(embedded, [1, 2], "grounded", 0.0, "prompt-lookup", 4, max_new_tokens=4, reps=1)
    assert [(r["batch"], r["method"]) for r in rows] == [
        (b, m) for b in (1, 2) for m in ("batched-spec", "batched-plain", "sequential-spec", "sequential-plain")]
    assert all(r["tokens_per_s"] > 0 for r in rows) and "| 2 | batched-spec | prompt-lookup | 4 |" in batch_table(rows)


def test_selfconsistency_rows(embedded):
    """n samples of one prompt as one batch, per method; point-mass methods sample plain decoding's texts
    (the runner checks it) and the engine's store is left as it was."""
    from exactspec.bench.selfconsistency import METHODS, load_selfconsistency, run_selfconsistency_bench

    work = load_selfconsistency()
    assert work["n"] == 8 and work["temperature"] == 0.7 and len(work["prompts"]) >= 4
    store = embedded.drafts.store
    rows = run_selfconsistency_bench(embedded, prompts=1, max_new_tokens=6, store_mb=2)
    assert embedded.drafts.store is store
    assert len(rows) == len(METHODS) and all(r["workload"] == "selfconsistency" and r["n"] == 8 for r in rows)
    assert all(r["tokens_per_s"] > 0 for r in rows) and rows[0]["speedup_vs_plain"] == 1.0


def test_quick_budget_cuts_the_work_by_the_measured_t1():
    """bench --quick's budget (bench/budget.py): the work fits the budget, priced at T(1) a token of
    every method; a slower target gets less of it, a fast one all; the floors hold."""
    from exactspec.bench.budget import MIN_TOKENS, QUICK_SECONDS, affordable, fit_batches, fit_sessions

    assert affordable(10, 3, 8) == 3 and affordable(10, 0.1, 8) == 8 and affordable(10, 30, 8, least=2) == 2
    assert affordable(10, 30, 1, least=4) == 1  # never more than asked
    # agent-repeat at T(1) = 62 ms (this 2-core CPU), 13 methods: 12 sessions of 3 steps asked, a kind seen twice
    token_s = 13 * 0.062
    sessions, steps, tokens = fit_sessions(QUICK_SECONDS, token_s, 12, 3, 64, least_sessions=4)
    assert (sessions, steps) == (4, 1) and MIN_TOKENS <= tokens < 64
    assert sessions * steps * tokens * token_s <= QUICK_SECONDS
    assert fit_sessions(QUICK_SECONDS, token_s / 100, 12, 3, 64, 4) == (12, 3, 64)  # a fast GPU: the whole workload
    slow = fit_sessions(QUICK_SECONDS, token_s * 100, 12, 3, 64, 4)
    assert slow == (4, 1, MIN_TOKENS)  # the floors: a bound on the work, not a promise of its time
    # selfconsistency: 4 methods' batches of 8 rows; 8 prompts asked
    assert fit_batches(QUICK_SECONDS, 4 * 0.01, 8, 96) == (8, 96)
    prompts, tokens = fit_batches(QUICK_SECONDS, 4 * 0.1, 8, 96)
    assert prompts == 1 and tokens * 4 * 0.1 <= QUICK_SECONDS
    assert fit_batches(QUICK_SECONDS, 4 * 0.05, 8, 96) == (3, 96)


def test_budgeted_runners_cut_their_work_and_their_progress_bars(embedded):
    """With a budget nothing fits in, selfconsistency runs one prompt and agent-repeat its floor (every
    kind once and one again, a step each); their bars lose the units cut and end full; the rows keep
    their fields."""
    import io

    from tqdm import tqdm

    from exactspec.bench.agent import exactspec_agent_method, load_agent_repeat, run_agent_bench
    from exactspec.bench.selfconsistency import METHODS, run_selfconsistency_bench

    with tqdm(total=len(METHODS) * 2, file=io.StringIO()) as bar:
        rows = run_selfconsistency_bench(embedded, prompts=2, max_new_tokens=4, store_mb=2, progress=bar,
                                         budget_s=1e-3)
    assert bar.total == bar.n == len(METHODS) and len(rows) == len(METHODS)
    sessions = load_agent_repeat()["transcripts"]
    kinds = len({s["kind"] for s in sessions})
    with tqdm(total=len(sessions), file=io.StringIO()) as bar:
        rows = run_agent_bench(embedded, [exactspec_agent_method(embedded, None, 0, 8)], max_new_tokens=4,
                               progress=bar, name="agent-repeat", budget_s=1e-3)
    assert bar.total == bar.n == kinds + 1 and rows[0]["steps"] == kinds + 1
    assert {"workload", "temperature", "method", "drafter", "gamma", "tokens_per_s"} <= rows[0].keys()


def test_verification_rows_side_by_side(embedded):
    """bench --verification token,block: each speculative row once per rule, side by side per γ, with a
    `verification` field; a point-mass drafter (prompt lookup) keeps its token row alone, and the
    tables grow a verification column only when a row verified by block (the default output unchanged)."""
    methods = build_methods(embedded, ["prompt-lookup", "bigram"], [2], auto=False, hf=False,
                            verifications=("token", "block"))
    assert [(m.method, m.drafter, m.verification) for m in methods] == [
        ("exactspec-plain", None, None), ("exactspec-spec", "prompt-lookup", "token"),
        ("exactspec-spec", "bigram", "token"), ("exactspec-spec", "bigram", "block")]
    rows = run_bench(embedded, methods, ["chat"], [1.0], prompts_per_workload=1, reps=1, max_new_tokens=6)
    assert [r["verification"] for r in rows] == [None, "token", "token", "block"]
    assert all(r["tokens_per_s"] > 0 and r["tokens_per_target_call"] >= 1 for r in rows)
    table = to_markdown(rows)
    assert "| γ | verification | tokens/s |" in table and "| bigram | 2 | block | " in table
    token_only = to_markdown([r for r in rows if r["verification"] != "block"])
    assert "verification" not in token_only and token_only.splitlines()[0].startswith("| workload | T | method | drafter | γ | tokens/s |")


def test_verification_option_is_checked_before_the_model_loads():
    parser = argparse.ArgumentParser()
    add_bench_subcommand(parser.add_subparsers())
    for argv, message in ((["--verification", "token,tree"], "comma list of token, block"),
                          (["--verification", "block", "--batch", "1,2"], "not with --batch")):
        args = parser.parse_args(["bench", *argv])
        with pytest.raises(ExactSpecError, match=message):
            args.func(args)
