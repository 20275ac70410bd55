"""Grammars: constraint specs compiled to llguidance grammars, and the matcher that follows one.

`grammar_from_spec` turns a request's constraint (OpenAI `response_format`, a regex, a Lark grammar, a
JSON schema or a pydantic model) into an llguidance grammar, refusing one that is invalid or that
matches no text; `Matcher` keeps a compiled grammar at a generation's accepted prefix and reads the
masks and forced tokens `law.TargetLaw` applies (the exactness argument lives there).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import torch

from ..errors import ExactSpecError
from .lark_finite import nonterminating

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: no unbounded whitespace, more forced tokens
# A tool's schema is the client's, never refused for a keyword llguidance cannot hold exactly: `oneOf`
# becomes `anyOf` (its alternatives may overlap), other unknown keywords are left out (lenient).
LENIENT_SCHEMA = {"coerce_one_of": True, "lenient": True}
TOOL_JSON_OPTIONS = {**JSON_OPTIONS, **LENIENT_SCHEMA}


def _llg():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise ExactSpecError("constrained decoding needs llguidance (pip install llguidance)") from e
    return llguidance


def grammar_from_spec(spec) -> str | None:
    """A constraint spec -> an llguidance grammar (None: unconstrained). Accepts OpenAI's
    `response_format` ({"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema",
    "strict"}}), the extensions {"type": "regex", "regex": RE} and {"type": "grammar" | "lark", "grammar":
    LARK} (with "subgrammars": {NAME: spec}, grammars its `@NAME` references), a JSON schema dict under
    {"type": "json_schema", "schema": ...}, or a pydantic model class."""
    llg = _llg()
    if spec is None:
        return None
    if isinstance(spec, type) and hasattr(spec, "model_json_schema"):  # a pydantic model
        return json_schema_grammar(spec.model_json_schema(), strict=True)
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise ExactSpecError(f"a constraint is a dict with a 'type' (text, json_object, json_schema, regex, grammar), "
                             f"got {spec!r:.80}")
    kind = spec["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, strict=False)
    if kind == "json_schema":
        inner = spec.get("json_schema", spec)
        if not isinstance(inner, dict):
            raise ExactSpecError("json_schema must be an object with 'name' and 'schema'")
        if "json_schema" in spec and not isinstance(inner.get("name"), str):
            raise ExactSpecError("json_schema.name is required")
        if "schema" not in inner:
            raise ExactSpecError("json_schema.schema is required (for any JSON, use {\"type\": \"json_object\"})")
        schema = inner["schema"]
        if not isinstance(schema, dict):
            raise ExactSpecError("json_schema.schema must be a JSON object")
        return json_schema_grammar(schema, strict=bool(inner.get("strict", False)))
    if kind == "regex":
        if not isinstance(spec.get("regex"), str):
            raise ExactSpecError("a regex constraint needs 'regex': a string")
        return _checked(llg.LLMatcher.grammar_from_regex(spec["regex"]), "regex", strict=False)
    if kind in ("grammar", "lark"):
        text = spec.get("grammar", spec.get("lark"))
        if not isinstance(text, str):
            raise ExactSpecError("a grammar constraint needs 'grammar': a Lark grammar as a string")
        grammar = llg.LLMatcher.grammar_from_lark(text)
        if spec.get("subgrammars"):  # checked whole: alone, its `@name` references are unknown
            grammar = _with_subgrammars(grammar, spec["subgrammars"])
        grammar = _checked(grammar, "grammar", strict=False)
        if endless := nonterminating(text):  # llguidance compiles these, then allows "x" forever
            raise ExactSpecError(f"invalid grammar: it has no finite derivation: {_endless(endless)}")
        return grammar
    raise ExactSpecError(f"unknown constraint type {kind!r}: choose text, json_object, json_schema, regex or grammar")


def _with_subgrammars(grammar: str, subgrammars: dict) -> str:
    """A Lark grammar's compiled form with more grammars beside it, each a constraint spec under the
    name its `@name` references give it (a free-form tool's Lark grammar or regex, inside a call)."""
    top = _top_level(grammar)
    for name, sub in subgrammars.items():
        compiled = grammar_from_spec(sub)
        if compiled is None:
            raise ExactSpecError(f"subgrammar {name!r} constrains nothing")
        top["grammars"].append({**_top_level(compiled)["grammars"][0], "name": name})
    return json.dumps(top)


def _top_level(grammar: str) -> dict:
    """llguidance's grammar list of a compiled grammar (a JSON list of grammars, or bare Lark text)."""
    return json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}


def _endless(rules: list[str]) -> str:
    names = ", ".join(repr(name) for name in rules[:5]) + (", ..." if len(rules) > 5 else "")
    return (f"rule {names} never terminates (every alternative needs it again)" if len(rules) == 1 else
            f"rules {names} never terminate (every alternative of each needs one of them again)")


def json_schema_grammar(schema: dict, strict: bool) -> str:
    """A JSON schema -> grammar; under `strict` an unsupported keyword or format is an error, otherwise
    unknown keywords are ignored."""
    llg = _llg()
    try:
        schema = _refuted(schema)
    except RecursionError:
        raise ExactSpecError("invalid JSON schema: nested deeper than Python's recursion allows") from None
    if schema is False:
        raise ExactSpecError('the constraint matches no text: the JSON schema\'s "not" excludes every value')
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides={**JSON_OPTIONS, "lenient": not strict})
    except (ValueError, TypeError) as e:
        raise ExactSpecError(f"invalid JSON schema: {e}") from None
    return _checked(grammar, "JSON schema", strict)


# where a JSON schema holds subschemas: maps of them, single ones, lists of them ("items": either)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
               "contains", "propertyNames", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")
_ANNOTATIONS = {"title", "description", "$comment", "examples", "default", "deprecated", "readOnly", "writeOnly"}


def _refuted(schema):
    """The schema with every subschema whose `"not"` holds a schema all values satisfy ({}, true, or
    annotations only) replaced by `false`, the schema no value satisfies. llguidance does not
    implement `not` and, lenient, ignores it: `{"not": {}}`, which matches nothing, would allow any
    JSON. Other `not`s stay (ignored, or refused under strict, by llguidance)."""
    if not isinstance(schema, dict):
        return schema
    excluded = schema.get("not")
    if excluded is True or (isinstance(excluded, dict) and excluded.keys() <= _ANNOTATIONS):
        return False
    out = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _refuted(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_refuted(sub) for sub in value]
        elif key in _SCHEMA_ONE:
            out[key] = _refuted(value)
    return out


def _checked(grammar: str, what: str, strict: bool) -> str:
    is_error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or (strict and messages):
        raise ExactSpecError(f"invalid {what}: {_one_line(messages[0]) if messages else 'rejected'}")
    return grammar


def _one_line(message: str) -> str:
    """llguidance's multi-line diagnostics (source excerpt, carets) -> their first line and 'error:' lines."""
    lines = [line.strip() for line in message.strip().splitlines()]
    return "; ".join([lines[0], *(line for line in lines[1:] if line.startswith("error:"))])


class Matcher:
    """An llguidance matcher kept at the accepted prefix; reads masks along a draft window and rolls back."""

    def __init__(self, llg_tok, grammar: str, vocab_size: int):
        self.m, self.tok = _llg().LLMatcher(llg_tok, grammar, log_level=0), llg_tok
        if self.m.is_error():
            raise ExactSpecError(f"invalid grammar: {self.m.get_error()}")
        self.vocab_size = vocab_size
        self.eos = set(llg_tok.eos_tokens)  # once the grammar is stopped, EOS repeats (stop_on_eos=False)

    def mask(self) -> torch.Tensor:
        """[V] bool: tokens allowed next."""
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if self.m.is_error():  # e.g. a language with no string at all ({"$ref": "#"}, [^\s\S])
            raise ExactSpecError(f"the constraint matches no text here: {_one_line(self.m.get_error()).split(';')[0]}")
        out = np.zeros(self.vocab_size, dtype=bool)
        n = min(len(bits), self.vocab_size)
        out[:n] = bits[:n]
        if not out.any():
            raise ExactSpecError(f"the grammar allows no token here: {self.m.get_error() or 'dead end'}")
        return torch.from_numpy(out)

    def masks_along(self, drafts: list[int]) -> tuple[int, list[torch.Tensor]]:
        """(number of valid leading drafts n, masks after d_<i for i = 0..n); the state is unchanged."""
        n = self.valid_prefix(drafts)
        masks, consumed = [self.mask()], 0
        for i in range(n):
            consumed += self.consume([drafts[i]])
            masks.append(self.mask())
        self.rollback(consumed)
        return n, masks

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens the grammar allows (EOS repeats once it is complete)."""
        n = self.m.validate_tokens(tokens) if tokens and not self.m.is_stopped() else 0
        while n < len(tokens) and tokens[n] in self.eos and (self.m.is_stopped() or (n and tokens[n - 1] in self.eos)):
            n += 1
        return n

    def forced(self) -> list[int]:
        """The text the grammar forces next, as the tokenizer's canonical tokens (JSON keys, punctuation,
        schema constants). llguidance's own forced tokens are the part no later byte can re-tokenize:
        `{"name` of `{"name":"`, whose `":"` might still merge with the value's first bytes. The
        canonical tokens of all the forced bytes are what a model trained on canonical tokenization
        emits nearly always; as point-mass drafts they stay exact whatever the target picks."""
        if self.m.is_stopped():
            return []
        sure = list(self.m.compute_ff_tokens())
        text = self.m.compute_ff_bytes()
        canonical = list(self.tok.tokenize_bytes(text)) if text else []
        return canonical if canonical[: len(sure)] == sure else sure

    def commit(self, tokens: list[int]) -> None:
        if self.valid_prefix(tokens) != len(tokens):
            raise ExactSpecError(f"internal error: emitted tokens {tokens} break the grammar")
        self.consume(tokens)

    def consume(self, tokens: list[int]) -> int:
        """Consume valid tokens (EOS after the end is not consumed); -> how many were consumed, the
        count `rollback` takes to return here."""
        consumed = 0
        for t in tokens:
            if self.m.is_stopped() and t in self.eos:
                continue
            if not self.m.consume_token(t):  # e.g. a rule with more alternatives than its parser allows
                raise ExactSpecError(f"grammar matcher error: {_one_line(self.m.get_error())}")
            consumed += 1
        return consumed

    def rollback(self, consumed: int) -> None:
        """Undo the last `consumed` tokens (the count `consume` returned)."""
        if consumed:
            self.m.rollback(consumed)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but EOS."""
        return self.m.is_stopped()

    def copy(self) -> "Matcher":
        """A matcher at this one's state that shares its compiled grammar: a request's samples each
        get one of the request's template, the grammar compiled once."""
        twin = copy.copy(self)
        twin.m = self.m.deep_copy()
        return twin
