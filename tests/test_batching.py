"""The one scheduler (batching.py): jobs of mixed settings share one batch, each exactly what it is
alone; and `exactspec batch` (scale/batch.py) sends every line through the server's translation, so
each field of the request schema is honoured or refused for that line alone — never dropped. They
decode on the embedded GGUF's 16-row llama.cpp engine (what `serve` and `batch` run on a CPU)."""

from __future__ import annotations

import json
import re

import pytest

from exactspec.batching import Delivery, Job, Scheduler, run_jobs
from exactspec.models.llamacpp.numerics import CANDIDATES
from exactspec.scale.batch import run_lines
from exactspec.server.schemas import ChatCompletionRequest, CompletionRequest
from exactspec.stats import Stats

COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # greedy keeps counting: no early EOS
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
GREEDY = {"prompt": COUNTING, "max_tokens": 8, "temperature": 0}
CHAT = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
TOOL = {"type": "function", "function": {"name": "paint", "parameters": {
    "type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
    "required": ["colour"], "additionalProperties": False}}}


def job(engine, prompt, seed: int | None = None, chat_template: bool = False, **settings) -> Job:
    return Job(engine.new_result(prompt, chat_template), engine.request(**settings), seed)


def test_mixed_settings_share_one_batch_each_as_alone(llamacpp_rows):
    """Greedy, sampled, lenient, constrained and logprob rows: ONE batch (fewer target forwards than the
    rows ran), each row's output its lone run's."""
    settings = [dict(temperature=0), dict(temperature=1.0, top_p=0.9), dict(temperature=0.8, lenience=0.5, gamma=3),
                dict(temperature=0, response_format={"type": "regex", "regex": "[0-9]{4}"}),
                dict(temperature=0.7, logprobs=2, gamma=0)]
    jobs = [[job(llamacpp_rows, COUNTING, seed=i, max_new_tokens=10, **s)] for i, s in enumerate(settings)]
    stats = Stats()
    assert run_jobs(llamacpp_rows, jobs, stats) == [None] * len(jobs)
    assert stats.target_calls < sum(j.result.stats.target_calls for [j] in jobs)
    for i, ([j], s) in enumerate(zip(jobs, settings)):
        alone = llamacpp_rows.generate(COUNTING, max_new_tokens=10, seed=i, chat_template=False, **s)
        assert j.result.token_ids == alone.token_ids, s
    assert len(jobs[-1][0].result.logprobs) == len(jobs[-1][0].result.token_ids)


def ignore(event) -> None:
    pass


@pytest.mark.parametrize("seed", [None, 3])
def test_a_long_prompt_joins_in_chunks_while_others_stream(llamacpp_rows, seed):
    """Chunked prefill: a ~400-token prompt joining a streaming row is prefilled 64 tokens per iteration,
    so the running row keeps getting tokens meanwhile (today's whole prefill froze it); both outputs are
    what each gives alone, greedy and seeded (a request's 2 samples copy the finished prefill)."""
    chunked_join(llamacpp_rows, seed)


def chunked_join(engine, seed: int | None) -> None:
    """A running row, then two samples of a ~400-token prompt joining it in 64-token chunks: the running
    row streams through the prefill, and every output is what it is alone."""
    sampling = dict(temperature=0) if seed is None else dict(temperature=0.9, top_p=0.95)
    long_prompt = "Summarise: " + " ".join(f"item {i} costs {i * 7 % 13} euros;" for i in range(45))
    running = job(engine, COUNTING, seed=seed, max_new_tokens=40, **sampling)
    joiners = [job(engine, long_prompt, seed=None if seed is None else seed + k, max_new_tokens=6, **sampling)
               for k in range(2)]
    events: list[str] = []
    scheduler = Scheduler(engine, prefill_chunk=64)
    scheduler.admit([[Delivery(running, lambda e: events.append("running"))]])
    scheduler.step()
    scheduler.admit([[Delivery(j, lambda e, k=k: events.append(f"joiner{k}")) for k, j in enumerate(joiners)]])
    prompt_tokens = len(joiners[0].result.prompt_token_ids)
    assert prompt_tokens > 380 and scheduler.rows == 3
    while scheduler.rows:
        scheduler.step()
    before_first = events.index("joiner0")
    assert events[:before_first].count("running") >= prompt_tokens // 64 - 1  # streamed through the prefill
    if seed is None:  # greedy: the second sample is the first's
        assert joiners[1].result.token_ids == joiners[0].result.token_ids
    for j in [running, joiners[0]] + ([] if seed is None else [joiners[1]]):
        prompt = COUNTING if j is running else long_prompt
        alone = engine.generate(prompt, max_new_tokens=j.request.max_new_tokens, chat_template=False,
                                seed=j.seed, **sampling)
        assert j.result.token_ids == alone.token_ids
    assert joiners[0].result.stats.prefill_tokens == prompt_tokens - 1 == joiners[1].result.stats.prefill_tokens


def _setting_id(setting) -> str:
    return setting.describe(2).replace(" ", "-")


@pytest.mark.parametrize("setting", CANDIDATES, ids=_setting_id)
def test_chunked_prefill_on_every_setting_the_self_test_can_choose(embedded_llamacpp, setting):
    """The chunked join on each llama.cpp setting the self-test may pick (forced here, whichever it picked
    on this CPU), on 4 batched rows: greedy outputs equal each prompt alone. On `make setup`'s patched
    build every candidate is bit-exact (each keeps one-token steps on the kernels blocks use), so a
    difference fails; a stock build, where the unpadded tiled one is not, skips and says so."""
    import llama_cpp

    from exactspec.engine import Engine
    from exactspec.models.llamacpp.adapter import load_llama_cpp

    from .conftest import patched_llama_cpp

    patched = patched_llama_cpp()
    if not patched and setting.prefill_tile and not setting.pad:
        pytest.skip(f"a stock llama-cpp-python build ({llama_cpp.__version__}): unpadded tiles need the patched one")
    lm = load_llama_cpp(embedded_llamacpp.target.path, n_ctx=1024, threads=2, rows=4, **setting.llama_kwargs())
    if setting.single_threads:
        lm.set_single_threads(setting.single_threads)
    lm.cost_key = f"chunked-test|{lm.path}"
    engine = Engine(lm, embedded_llamacpp.tokenizer, "prompt-lookup", 4)
    engine.backend = "llama.cpp"
    try:
        chunked_join(engine, None)
    finally:
        lm.close()


def test_a_prompt_the_prefix_cache_holds_whole_joins_a_running_row(llamacpp_rows):
    """Chunked prefill with nothing left to prefill: the prefix cache holds a joining prompt whole (an
    agent's replayed step), so its first chunk is empty -- it joins, and decodes what it does alone."""
    from .conftest import prefix_cached

    engine = llamacpp_rows
    prompt = "Summarise: " + " ".join(f"item {i} costs {i * 7 % 13} euros;" for i in range(20))
    alone = engine.generate(prompt, max_new_tokens=6, chat_template=False, temperature=0)
    with prefix_cached(engine):
        scheduler = Scheduler(engine, prefill_chunk=64)
        for k in range(2):  # the first joiner fills the cache, the second finds its whole prompt there
            # the running row samples (seeded: the same passes every run), the joiner is greedy, as `alone`
            running = job(engine, COUNTING, seed=k, max_new_tokens=12)
            joiner = job(engine, prompt, max_new_tokens=6, temperature=0)
            scheduler.admit([[Delivery(running, ignore)]])
            scheduler.step()
            events = []
            scheduler.admit([[Delivery(joiner, events.append)]])
            while scheduler.rows:
                scheduler.step()
            assert events[-1][0] == "done" and joiner.result.token_ids == alone.token_ids, (k, events[-1])
        assert joiner.result.stats.cached_tokens == len(joiner.result.prompt_token_ids) - 1


def test_admission_is_one_rule(embedded):
    """Lenient rows share a batch, rows drafting with the draft model (one cache) do not; with one row
    at a time nothing does, and a request's samples are queued one by one; a failing setup fails its
    job alone."""
    lenient = job(embedded, COUNTING, temperature=0.8, lenience=0.5)
    assert Scheduler(embedded).shares(lenient) and not Scheduler(embedded, max_rows=1).shares(lenient)
    assert not Scheduler(embedded).shares(job(embedded, COUNTING, draft="model"))
    deliveries = [Delivery(lenient, ignore), Delivery(job(embedded, COUNTING), ignore)]
    assert Scheduler(embedded).entries(deliveries) == [deliveries]
    assert Scheduler(embedded, max_rows=1).entries(deliveries) == [[d] for d in deliveries]
    bad = job(embedded, COUNTING, draft="no-such-drafter", max_new_tokens=4)
    good = job(embedded, COUNTING, max_new_tokens=4, temperature=0)
    errors = run_jobs(embedded, [[bad], [good]])
    assert "no-such-drafter" in str(errors[0]) and errors[1] is None and len(good.result.token_ids) == 4


# --- exactspec batch: every field of the request schema ----------------------------------------------
# Each check(engine, out, line) asserts what the line's output must be: honoured fields change it as
# they should (and could not pass were the field dropped), refused ones give the line an error.
def alone(engine, line: dict, **sampling):
    """The lone generation a line asks for (what the server would answer)."""
    prompt = line.get("messages") or line["prompt"]
    return engine.generate(prompt, max_new_tokens=line["max_tokens"], chat_template="messages" in line, **sampling)


def greedy(engine, out, line):
    assert "error" not in out, out
    assert out["token_ids"] == alone(engine, line, temperature=0).token_ids


def as_alone(**sampling):
    """The lone run's tokens with these settings, which differ from plain greedy's."""
    def check(engine, out, line):
        assert "error" not in out, out
        assert out["token_ids"] == alone(engine, line, **sampling).token_ids
        assert out["token_ids"] != alone(engine, line, temperature=0).token_ids, "the setting changes nothing here"
    return check


def tokens(n: int):
    def check(engine, out, line):
        assert len(out["token_ids"]) == n, out
    return check


def clamped(engine, out, line):
    """A budget past the context: the rest of the context, never a refusal (agent CLIs send 32,000)."""
    assert out["finish_reason"] == "length" and len(out["token_ids"]) < engine.target.max_length, out


def refused(pattern: str):
    def check(engine, out, line):
        assert "text" not in out and re.search(pattern, out["error"]), out
    return check


def banana(engine) -> int:
    return engine.tokenizer.encode(" banana", add_special_tokens=False)[0]


def stopped(engine, out, line):
    assert out["finish_reason"] == "stop" and out["text"] == " 9, ", out


def no_drafts(engine, out, line):
    assert out["stats"]["proposed"] == 0 and out["stats"]["target_calls"] == len(out["token_ids"]), out


def lossy(engine, out, line):
    assert out["stats"]["lenience"] == 0.5 and out["stats"]["exact"] is False, out


def point_masses_by_token_rule(engine, out, line):
    """This engine drafts by prompt lookup (point masses): under block they keep the coupled token rule."""
    assert out["token_ids"] == alone(engine, line, temperature=1.0, seed=3).token_ids, out
    assert out["stats"]["block_verified"] == 0 and out["stats"]["proposed"] > 0, out


def matches(engine, out, line):
    assert re.fullmatch("[a-c]{3}", out["text"]) and out["finish_reason"] == "stop", out


def biased(engine, out, line):
    assert out["token_ids"] == [banana(engine)] * line["max_tokens"], out


def text_logprobs(engine, out, line):
    lp = out["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(out["token_ids"]) == len(lp["top_logprobs"])


def chat_logprobs(engine, out, line):
    content = out["logprobs"]["content"]
    assert len(content) == len(out["token_ids"]) and all(len(e["top_logprobs"]) == 3 for e in content)


def tool_called(engine, out, line):
    [call] = out["tool_calls"]
    assert out["finish_reason"] == "tool_calls" and call["function"]["name"] == "paint"
    assert json.loads(call["function"]["arguments"])["colour"] in ("red", "blue")


def tools_not_shown(engine, out, line):
    assert "tool_calls" not in out
    greedy(engine, out, CHAT)


SAMPLED = {**CHAT, "temperature": 1.0, "seed": 3}  # its sample differs from greedy: a dropped warp shows
CASES = [  # (fields covered, line, check); all lines run in ONE batch
    ({"prompt", "model"}, {**GREEDY, "model": "anything"}, greedy),
    ({"messages"}, CHAT, greedy),
    ({"max_tokens"}, {**GREEDY, "max_tokens": 3}, tokens(3)),
    ({"max_tokens"}, {"prompt": COUNTING, "temperature": 0}, tokens(5)),  # the command's --max-tokens, not 16
    ({"max_completion_tokens"}, {**CHAT, "max_completion_tokens": 3}, tokens(3)),
    ({"temperature", "seed"}, SAMPLED, as_alone(temperature=1.0, seed=3)),
    ({"top_k"}, {**SAMPLED, "top_k": 1}, greedy),
    ({"top_p"}, {**SAMPLED, "top_p": 0.001}, greedy),
    ({"min_p"}, {**SAMPLED, "min_p": 1.0}, greedy),
    ({"stop"}, {**GREEDY, "stop": ["10"]}, stopped),
    ({"gamma"}, {**GREEDY, "gamma": 0}, no_drafts),
    ({"lenience"}, {**GREEDY, "temperature": 0.8, "seed": 1, "lenience": 0.5}, lossy),
    ({"verification"}, {**SAMPLED, "verification": "block"}, point_masses_by_token_rule),
    ({"verification"}, {**SAMPLED, "verification": "block", "lenience": 0.5}, refused("verification: block .* exact only")),
    ({"response_format"}, {**GREEDY, "response_format": {"type": "regex", "regex": "[a-c]{3}"}}, matches),
    ({"logit_bias"}, {**GREEDY, "logit_bias": "banana"}, biased),
    ({"presence_penalty"}, {**GREEDY, "presence_penalty": 2.0}, as_alone(temperature=0, presence_penalty=2.0)),
    ({"frequency_penalty"}, {**GREEDY, "frequency_penalty": 2.0}, as_alone(temperature=0, frequency_penalty=2.0)),
    ({"repetition_penalty"}, {**GREEDY, "repetition_penalty": 3.0}, as_alone(temperature=0, repetition_penalty=3.0)),
    ({"logprobs"}, {**GREEDY, "logprobs": 2}, text_logprobs),
    ({"top_logprobs"}, {**CHAT, "logprobs": True, "top_logprobs": 3}, chat_logprobs),
    ({"tools", "tool_choice"}, {**CHAT, "max_tokens": 24, "tools": [TOOL], "tool_choice": "required"}, tool_called),
    ({"tools", "tool_choice"}, {**CHAT, "tools": [TOOL], "tool_choice": "none"}, tools_not_shown),
    ({"best_of"}, {**GREEDY, "best_of": 1}, greedy),
    ({"n"}, {**GREEDY, "n": 2}, refused("n must be 1")),
    ({"stream"}, {**GREEDY, "stream": True}, refused(r"^line \d+: stream: ")),
    ({"stream_options"}, {**GREEDY, "stream_options": {"include_usage": True}}, refused("stream_options")),
    ({"echo"}, {**GREEDY, "echo": True}, refused("echo")),
    ({"suffix"}, {**GREEDY, "suffix": "x"}, refused("suffix")),
    ({"best_of"}, {**GREEDY, "best_of": 2}, refused("best_of")),
    ({"top_logprobs"}, {**CHAT, "top_logprobs": 3}, refused("top_logprobs needs logprobs")),
    ({"response_format"}, {**GREEDY, "response_format": {"type": "regex", "regex": "("}}, refused("response_format")),
    ({"tools"}, {**CHAT, "tools": [TOOL], "response_format": {"type": "json_object"}}, refused("not both")),
    ({"max_tokens"}, {**GREEDY, "max_tokens": 10**7}, clamped),  # past the context: what it leaves
    ({"continue_final_message"}, {**CHAT, "max_tokens": 3, "continue_final_message": True,
                                  "messages": [*MESSAGES, {"role": "assistant", "content": "Sure:"}]}, tokens(3)),
    ({"messages"}, {**CHAT, "messages": []}, refused("messages")),
]


def line_of(engine, i: int, fields: dict) -> str:
    if fields.get("logit_bias") == "banana":
        fields = {**fields, "logit_bias": {str(banana(engine)): 100}}
    return json.dumps({"id": f"case{i}", **fields})


@pytest.fixture(scope="module")
def outputs(llamacpp_rows) -> list[dict]:
    """Every case's line in ONE run (one batch of mixed settings); --max-tokens 5."""
    return run_lines(llamacpp_rows, [(i + 1, line_of(llamacpp_rows, i, line)) for i, (_, line, _) in enumerate(CASES)], 5)


def test_every_schema_field_has_a_case():
    fields = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    assert fields - set().union(*(covered for covered, _, _ in CASES)) == set()


@pytest.mark.parametrize("i", range(len(CASES)), 
                         ids=[f"{'+'.join(sorted(c))}-{i}" for i, (c, _, _) in enumerate(CASES)])
def test_a_batch_line_field_is_honoured_or_refused(llamacpp_rows, outputs, i):
    _, line, check = CASES[i]
    assert outputs[i]["id"] == f"case{i}"
    check(llamacpp_rows, outputs[i], line)


def test_a_joining_prompt_keeps_its_plan_when_a_row_ahead_of_it_leaves(llamacpp_rows):
    """A running row finishes while a long prompt is being prefilled in chunks behind it: the joining row
    moves up (select_rows) with what is left of its prefill plan, and decodes what it does alone."""
    engine = llamacpp_rows
    prompt = "Summarise: " + " ".join(f"item {i} costs {i * 7 % 13} euros;" for i in range(40))
    alone = engine.generate(prompt, max_new_tokens=6, chat_template=False, temperature=0, gamma=0)
    scheduler = Scheduler(engine, prefill_chunk=64)
    leaving = job(engine, COUNTING, seed=1, max_new_tokens=2, gamma=0)
    staying = job(engine, COUNTING, seed=2, max_new_tokens=40, gamma=0)
    joiner = job(engine, prompt, max_new_tokens=6, gamma=0, temperature=0)  # greedy, as `alone`
    scheduler.admit([[Delivery(leaving, ignore)], [Delivery(staying, ignore)]])
    scheduler.step()
    events = []
    scheduler.admit([[Delivery(joiner, events.append)]])
    while scheduler.rows:
        scheduler.step()
    assert leaving.result.stats.emitted == 2 and len(joiner.result.prompt_token_ids) > 3 * 64  # it left mid-prefill
    assert events[-1][0] == "done" and joiner.result.token_ids == alone.token_ids, events[-1]
