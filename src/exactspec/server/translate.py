"""Request translation: an OpenAI request body -> the worker's jobs, one per sample, or an `ApiError`.

Plain functions of the engine and the body, no HTTP: the app runs them on its preparing thread
(offload.py), tests call them directly. A request is checked against limits.py, its messages
rendered (tool history and tool prompt included) and tokenised, and its constraint compiled ONCE:
the n jobs of a request share one `generation.Request` (each sample gets its own matcher state).
"""

from __future__ import annotations

from ..batching import Job
from ..chat_prompt import encode_chat
from ..engine import Engine
from ..errors import ExactSpecError, FieldError
from ..generation import GenerationResult, LawSpec, Request
from ..speculative.params import POINT_MASS_DRAFTS
from ..speculative.sampling import SamplingParams
from ..detokenize import IncrementalText
from .api_error import ApiError
from .families import family_of, special_tokens
from .history import fold_late_system, for_template
from .limits import check_constraint, check_stops
from .schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest
from .tools import ToolPlan, plan_tools

MAX_TOKENS_DEFAULT = 2048  # the token budget of a request without max_tokens (serve --max-tokens-default)


def plan_text(engine: Engine, body: CompletionRequest, max_tokens_default: int | None = MAX_TOKENS_DEFAULT,
              openai_budget: bool = True) -> list[Job]:
    """A text completion's jobs: the prompt is fed as raw text, no chat template. Without max_tokens
    the budget is OpenAI's 16, or with `openai_budget=False` a chat request's (the rest of the
    context, at most `max_tokens_default`: `exactspec batch`)."""
    budget = body.token_budget() if openai_budget or body.max_tokens is not None else None
    return plan(engine, body, body.text(), False, budget, "prompt", max_tokens_default=max_tokens_default)


def plan_chat(engine: Engine, body: ChatCompletionRequest,
              max_tokens_default: int | None = MAX_TOKENS_DEFAULT) -> tuple[list[Job], ToolPlan | None]:
    """A chat request's tools, messages (tool history included, see history.py) and jobs."""
    template = getattr(engine.tokenizer, "chat_template", None)
    try:
        parallel = (body.model_extra or {}).get("parallel_tool_calls", True)
        family = family_of(template)
        tokens = special_tokens(family, engine.tokenizer) if family is not None and body.tools else None
        tools = plan_tools(body.tools, body.tool_choice, family, True if parallel is None else parallel, tokens)
    except FieldError as e:
        raise ApiError(400, str(e), e.param) from None
    messages = for_template(body.chat(), template, tools.custom if tools is not None else frozenset())
    prefill = messages.pop()["content"] if body.continue_final_message else ""
    if tools is not None and tools.family is None:  # the generic format: the tools in the system message
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + tools.system_prompt}
        else:
            messages.insert(0, {"role": "system", "content": tools.system_prompt})
    return plan(engine, body, messages, None, body.token_budget(), "messages", tools, max_tokens_default,
                prefill), tools


def plan(engine: Engine, body: GenerationRequest, prompt: str | list[dict], chat_template: bool | None,
         budget: int | None, prompt_param: str, tools: ToolPlan | None = None,
         max_tokens_default: int | None = MAX_TOKENS_DEFAULT, prefill: str = "") -> list[Job]:
    """Check and tokenise a request; one job per sample, all sharing one Request. `prefill`: the start of
    the answer, given (a continued last assistant message): after the generation prompt, its text as text
    (never parsed for special tokens), continued by the model."""
    sampling = dict(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
                    lenience=body.lenience, verification=body.verification)
    try:
        params = SamplingParams(**sampling)
        check_stops(body.stop_list())
    except FieldError as e:  # a stop string out of bounds, block verification with lenience < 1
        raise ApiError(400, str(e), e.param) from None
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    law = request_law(engine, body, tools)
    shown = tools.tools if tools is not None else None  # a tool family's template lays them out itself
    ids = prompt_ids(engine, prompt, chat_template, prompt_param, shown, prefill)
    context = engine.target.max_length
    room = context - (len(engine.target.decoder_prompt) if engine.is_encoder_decoder else len(ids))
    budget = min(budget, room) if budget else min(room, max_tokens_default or room)  # clamped, never refused
    try:
        request = Request(params, law, budget, body.stop_list(), body.gamma)
    except ExactSpecError as e:
        raise ApiError(400, str(e)) from None
    jobs = [Job(GenerationResult("", [], ids, "length"), request, seed=None if body.seed is None else body.seed + i)
            for i in range(body.n)]
    for job in jobs if tools is not None and tools.shown else []:  # the marker token's text stays in the output
        job.result.detokenizer = IncrementalText(engine.tokenizer, body.stop_list(), tools.shown)
    return jobs


def prompt_ids(engine: Engine, prompt: str | list[dict], chat_template: bool | None, prompt_param: str,
               tools: list[dict] | None = None, prefill: str = "") -> list[int]:
    """The prompt's token ids, checked to leave room in the context (a budget past it is clamped). `tools`:
    chat messages rendered with the template's own `tools` (a tool family's, families.py)."""
    def encode(prompt: str | list[dict]) -> list[int]:
        if tools:
            return encode_chat(engine.tokenizer, prompt, tools)
        return engine.new_result(prompt, chat_template).prompt_token_ids

    try:
        try:
            ids = encode(prompt)
        except Exception:  # a template that takes no system message past the first: those folded, once more
            if isinstance(prompt, str) or (folded := fold_late_system(prompt)) == prompt:
                raise
            ids = encode(folded)
    except Exception as e:  # ExactSpecError, or a chat template refusing the messages (jinja2 errors)
        raise ApiError(400, f"cannot encode the prompt: {e}", prompt_param) from None
    if prefill:
        ids = ids + engine.tokenizer.encode(prefill, add_special_tokens=False, split_special_tokens=True)
    context = engine.target.max_length
    if not ids:
        raise ApiError(400, "the prompt is empty", prompt_param)
    if len(ids) >= context:
        raise ApiError(400, f"prompt is too long: {len(ids)} tokens > {context - 1} maximum (the prompt has "
                            f"{len(ids)} tokens; this model's context is {context} tokens)",
                       prompt_param, "context_length_exceeded")
    return ids


def request_law(engine: Engine, body: GenerationRequest, tools: ToolPlan | None) -> LawSpec:
    """The request's grammar (or its tools' constraint), bias, penalties and logprobs, through the one
    translator (`generation.law_spec`, as `Engine.request` uses): the constraint first held to limits.py's
    bounds, compiled once (its samples share it) and able to match some text."""
    constraint, param = body.response_format, "tools" if tools is not None else "response_format"
    if tools is not None:
        if constraint is not None and constraint.get("type") != "text":
            raise ApiError(400, "give either response_format or tools, not both", "response_format")
        constraint = tools.constraint
    try:
        check_constraint(constraint, param)
        compiled = engine.law_spec(grammar=constraint, logit_bias=body.logit_bias,
                                   presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                   repetition_penalty=body.repetition_penalty, logprobs=body.logprobs_k())
        if compiled.matcher is not None:  # a language with no text fails here
            compiled.matcher.mask()
    except FieldError as e:  # limits.py's bounds, a bias key or value, a penalty
        raise ApiError(400, str(e), e.param) from None
    except ExactSpecError as e:
        raise ApiError(400, str(e), param) from None
    return compiled


def reproducible(engine: Engine, body: GenerationRequest) -> bool:
    """Whether the same request with the same seed gives the same text: greedy always; sampled with a
    point-mass drafter (prompt lookup, suffix, none) at lenience 1 too, whatever γ, auto γ, the store
    or the batch (verified with the plain sampler's coupling, the text is plain decoding's: see
    speculative/verify.py `verify_coupled`); with a sampling drafter (bigram, unigram, a draft model, auto)
    or lenience < 1 only at a fixed γ with a fixed drafter (auto γ and the auto drafter learn across
    requests and price by the batch, so they draft differently, and the sampler draws another sample)."""
    gamma = engine.gamma if body.gamma is None else body.gamma
    if SamplingParams(temperature=body.temperature).greedy:
        return True
    if engine.draft in POINT_MASS_DRAFTS and body.lenience == 1:
        return True
    return gamma != "auto" and engine.draft != "auto"
