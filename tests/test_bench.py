"""The side-by-side bench's constrained workload (`json`): shipped cases with schemas, the rows it adds
(unconstrained plain, forced-only speculation), greedy identity across its constrained rows, and the
forced / schema-valid shares it reports."""

from __future__ import annotations

from exactspec.bench.runner import build_methods, methods_for, run_bench, to_markdown
from exactspec.bench.workloads import WORKLOADS, load_cases, load_workload, schema_valid
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


def test_constrained_rows_decode_the_same_tokens(embedded):
    methods = build_methods(embedded, ["prompt-lookup"], [4], auto=False, hf=True, constrained=True)
    on_json = methods_for(methods, constrained=True)
    assert [(m.method, m.drafter) for m in on_json] == [
        ("exactspec-plain", None), ("exactspec-plain-unconstrained", None), ("exactspec-spec", "none"),
        ("exactspec-spec", "prompt-lookup")]  # HF generate has no grammar: not run on json
    assert "exactspec-plain-unconstrained" not in [m.method for m in methods_for(methods, constrained=False)]
    case = load_cases("json")[2]  # a tool call: many forced tokens, values copied from the prompt
    ids = embedded.encode(case.prompt)
    greedy = SamplingParams(temperature=0)
    out = {(m.method, m.drafter): m.run(ids, greedy, 120, 0, case.response_format) for m in on_json}
    constrained = [v for k, v in out.items() if k[0] != "exactspec-plain-unconstrained"]
    assert all(o[0] == constrained[0][0] for o in constrained)  # greedy identity under the grammar
    assert schema_valid(embedded.tokenizer.decode(constrained[0][0], skip_special_tokens=True), case.response_format)
    forced_only = out[("exactspec-spec", "none")][2]
    assert forced_only.forced_accepted > 10 and forced_only.tokens_per_target_call > 1.2


def test_json_rows(embedded):
    methods = build_methods(embedded, [], [4], auto=False, hf=False, constrained=True)
    rows = run_bench(embedded, methods, ["json"], [0.0], prompts_per_workload=1, reps=1, max_new_tokens=96)
    by = {(r["method"], r["drafter"]): r for r in rows}
    plain, free, forced = by[("exactspec-plain", None)], by[("exactspec-plain-unconstrained", None)], \
        by[("exactspec-spec", "none")]
    assert plain["constrained"] and not free["constrained"] and plain["valid_share"] == 1.0
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
