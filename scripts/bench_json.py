"""Structured output, side by side in one process at T=0: unconstrained plain, constrained plain (γ=0),
grammar-forced drafts only, forced + prompt lookup, on an extraction and a tool-call prompt with schemas.
Asserts the three constrained rows emit the same tokens; prints tokens/s ratios, tokens per target call,
share of forced tokens and whether every output parses.

    PYTHONPATH=src .venv/bin/python scripts/bench_json.py [torch|llama.cpp]
"""
import json, sys, time
import exactspec
backend = sys.argv[1] if len(sys.argv) > 1 else "torch"
e = exactspec.load(draft="prompt-lookup", gamma=4, backend=backend)
person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
          "email": {"type": "string"}}, "required": ["name", "age", "city", "email"], "additionalProperties": False}
tool = {"type": "object", "properties": {"function": {"const": "book_flight"}, "arguments": {"type": "object", "properties": {
    "origin": {"type": "string"}, "destination": {"type": "string"}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    "passengers": {"type": "integer"}}, "required": ["origin", "destination", "date", "passengers"], "additionalProperties": False}},
    "required": ["function", "arguments"], "additionalProperties": False}
cases = [("Extract the person: Maria Lopez, 41, lives in Madrid, maria.lopez@example.com. Return JSON.", person),
         ("Book a flight from Boston to Denver on 2025-03-14 for 2 passengers. Return the tool call as JSON.", tool)]
rows = {"plain unconstrained": dict(gamma=0), "plain constrained": dict(gamma=0, c=1),
        "forced only": dict(gamma=4, draft="none", c=1), "forced + prompt lookup": dict(gamma=4, c=1)}
e.generate("warm up", max_new_tokens=4, temperature=0)
tot = {k: [0, 0.0, 0, 0, True] for k in rows}
for rep in range(2):
    for prompt, schema in cases:
        outs = {}
        for name, o in rows.items():
            kw = dict(max_new_tokens=80, temperature=0, gamma=o["gamma"], draft=o.get("draft"))
            if o.get("c"):
                kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
            r = e.generate(prompt, **kw)
            outs[name] = r.token_ids
            t = tot[name]; t[0] += len(r.token_ids); t[1] += r.stats.decode_s; t[2] += r.stats.target_calls; t[3] += r.stats.forced
            if o.get("c"):
                try: json.loads(r.text); 
                except Exception: t[4] = False
        assert outs["plain constrained"] == outs["forced only"] == outs["forced + prompt lookup"]
base = tot["plain constrained"]
for k, (n, s, calls, forced, valid) in tot.items():
    print(f"{backend:9s} {k:24s} tokens={n} tok/s={n/s:6.1f} tokens/call={n/calls:4.2f} forced share={forced/n:4.2f} "
          f"valid_json={valid} speed vs plain constrained={(n/s)/(base[0]/base[1]):4.2f}x")
