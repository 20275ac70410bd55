"""The Responses API's tool types as an agent CLI sends them (shapes of ../shared/notes/agent-requests.md):
namespace groups flattened and their calls given back under the client's own (namespace, name), custom
tools as one-string functions given back as `custom_tool_call` items, hosted tools left out and named.
Pure functions: no model."""

from __future__ import annotations

import json

import pytest

from exactspec.server.openai_responses import ResponseStore, ResponsesDoor, input_messages, to_chat
from exactspec.server.doors import Call
from exactspec.server.responses_tools import read_tools
from exactspec.server.translate import ApiError

from ..helpers.agent_clis import PATCH_GRAMMAR

FUNCTION = {"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
GROUP = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
         "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}},
                   {"type": "function", "name": "wait_agent", "parameters": {"type": "object", "properties": {}}}]}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
         "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'}}
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "image_generation"},
          {"type": "mcp", "server_label": "x"}, {"type": "some_future_tool"}]


def test_an_agent_cli_s_tool_list_is_read_whole_never_refused():
    tools = read_tools([FUNCTION, GROUP, PATCH, *HOSTED])
    names = [t["function"]["name"] for t in tools.chat]
    assert names == ["exec_command", "multi_agent_v1__spawn_agent", "multi_agent_v1__wait_agent", "apply_patch"]
    assert tools.namespaced == {"multi_agent_v1__spawn_agent": ("multi_agent_v1", "spawn_agent"),
                                "multi_agent_v1__wait_agent": ("multi_agent_v1", "wait_agent")}
    assert tools.skipped == ["web_search", "image_generation", "mcp", "some_future_tool"]
    patch = tools.chat[-1]["function"]["parameters"]
    assert patch["required"] == ["input"] and patch["properties"]["input"] == {"type": "string"}


def test_a_call_goes_back_out_under_the_client_s_own_names():
    tools = read_tools([FUNCTION, GROUP, PATCH])
    grouped = tools.output_item("c1", "multi_agent_v1__wait_agent", "{}", "fc_1", "completed")
    assert (grouped["type"], grouped["name"], grouped["namespace"]) == ("function_call", "wait_agent", "multi_agent_v1")
    plain = tools.output_item("c2", "exec_command", '{"cmd":"ls"}', "fc_2", "completed")
    assert "namespace" not in plain and plain["arguments"] == '{"cmd":"ls"}'
    raw = tools.output_item("c3", "apply_patch", json.dumps({"input": "*** Begin Patch\n"}), "fc_3", "completed")
    assert raw["type"] == "custom_tool_call" and raw["input"] == "*** Begin Patch\n" and "arguments" not in raw


def test_a_later_turn_s_calls_render_under_the_names_the_model_was_shown():
    items = [{"type": "message", "role": "user", "content": "go"},
             {"type": "function_call", "call_id": "a", "name": "wait_agent", "namespace": "multi_agent_v1",
              "arguments": "{}"},
             {"type": "function_call_output", "call_id": "a", "output": "done"},
             {"type": "custom_tool_call", "call_id": "b", "name": "apply_patch", "input": "*** Begin Patch\n"},
             {"type": "custom_tool_call_output", "call_id": "b", "output": "applied"},
             {"type": "reasoning", "summary": [], "encrypted_content": "opaque"}]
    messages = input_messages(items)
    calls = [m["tool_calls"][0]["function"] for m in messages if m.get("tool_calls")]
    assert calls[0]["name"] == "multi_agent_v1__wait_agent"
    assert calls[1]["name"] == "apply_patch" and json.loads(calls[1]["arguments"]) == {"input": "*** Begin Patch\n"}
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["done", "applied"]


def test_the_stream_of_a_namespaced_and_a_custom_call():
    body = {"input": "go", "tools": [GROUP, PATCH], "stream": True}
    chat, conversation, tools = to_chat(body, ResponseStore())
    door = ResponsesDoor(body, conversation, ResponseStore(), "m", tools)
    events = door.opening(5)
    for call in (Call("c1", "multi_agent_v1__spawn_agent", "{}"), Call("c2", "apply_patch", '{"input":"*** Begin"}')):
        door.output.parts.append(call)
        door.items.append(tools.output_item(call.id, call.name, "", f"fc_{call.id}", "in_progress"))
        events += door._close()
    kinds = [json.loads(e.split("data: ", 1)[1])["type"] for e in events]
    assert "response.custom_tool_call_input.done" in kinds and "response.function_call_arguments.done" in kinds
    done = [json.loads(e.split("data: ", 1)[1]) for e in events if "output_item.done" in e]
    assert done[0]["item"]["namespace"] == "multi_agent_v1" and done[0]["item"]["name"] == "spawn_agent"
    assert done[1]["item"]["type"] == "custom_tool_call" and done[1]["item"]["input"] == "*** Begin"


@pytest.mark.parametrize("tools, where", [([{"type": "namespace", "name": "x"}], "tools[0]"),
                                          ([{"type": "namespace", "name": "x", "tools": [{"type": "function"}]}],
                                           "tools[0].tools[0].name"),
                                          ("web_search", "tools")])
def test_a_malformed_group_is_a_400_naming_it(tools, where):
    with pytest.raises(ApiError) as e:
        read_tools(tools)
    assert e.value.status == 400 and e.value.param == where


def test_the_store_is_bounded_in_bytes_and_metadata_by_the_api_s_limits():
    """Stored responses (previous_response_id) take at most the store's MiB, least recently used dropped
    first, one larger than the whole budget not kept; `metadata` past the API's limits is a 400; DELETE."""
    store = ResponseStore(entries=100, budget_mb=0.01)  # 10,485 bytes
    for i in range(10):
        store.put({"id": f"r{i}", "output": "x" * 2000}, [{"role": "user", "content": "hi"}])
    assert store.used <= store.budget and len(store._items) == 5
    with pytest.raises(ApiError):
        store.get("r0")
    assert store.get("r9")[0]["output"] == "x" * 2000
    store.put({"id": "huge", "output": "x" * 20_000}, [])
    with pytest.raises(ApiError):
        store.get("huge")
    store.delete("r9")
    with pytest.raises(ApiError) as e:
        store.delete("r9")
    assert e.value.status == 404
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 5}, "x"):
        with pytest.raises(ApiError) as e:
            to_chat({"input": "hi", "metadata": metadata}, ResponseStore())
        assert e.value.status == 400 and e.value.param.startswith("metadata")
    with pytest.raises(ApiError) as e:
        to_chat({"input": "hi", "store": "false"}, ResponseStore())
    assert e.value.param == "store"


CODEX_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files.", "format": {
    "type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}
EDIT = "*** Begin Patch\n*** Update File: a.txt\n@@\n-old\n+new\n*** End Patch\n"


@pytest.fixture(scope="module")
def accepts():
    """text -> whether a plan's grammar takes it, token by token (the embedded tokenizer)."""
    from exactspec.embedded import embedded_model_path
    from exactspec.models.torch_hf import load_tokenizer
    from exactspec.speculative.grammar import Matcher, grammar_from_spec
    from exactspec.models.light_tokenizer import llg_tokenizer

    tokenizer = load_tokenizer(embedded_model_path())
    tok = llg_tokenizer(tokenizer, len(tokenizer), {tokenizer.eos_token_id})

    def check(plan, text: str) -> bool:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return Matcher(tok, grammar_from_spec(plan.constraint), len(tokenizer)).valid_prefix(ids) == len(ids)

    return check


def test_a_free_form_call_is_written_raw_and_held_to_its_lark_grammar(accepts):
    """Codex's free-form `apply_patch`: TAG, its name, a newline, the patch, CUSTOM_CLOSE -- the patch under
    the tool's own Lark grammar (a wrong line is refused), read back as {"input": patch}; a function
    beside it keeps its JSON call, and text stays text."""
    from exactspec.server.tools import plan_tools

    plan = plan_tools(read_tools([FUNCTION, CODEX_PATCH]).chat, "auto")
    call = f"<tool_call>apply_patch\n{EDIT}</tool_call>"
    assert accepts(plan, call) and accepts(plan, "Done.") and accepts(plan, '<tool_call>{"name":"exec_command","arguments":{"cmd":"ls"}}')
    assert not accepts(plan, "<tool_call>apply_patch\n*** Begin Patch\nhello\n*** End Patch\n</tool_call>")
    assert not accepts(plan, '<tool_call>{"name":"apply_patch","arguments":{"input":"x"}}')  # raw, not JSON
    content, [got] = plan.read(call, True)
    assert content is None and got["function"]["name"] == "apply_patch"
    assert json.loads(got["function"]["arguments"]) == {"input": EDIT}
    assert plan.read(call[:-3], True) == (call[:-3], None)  # cut short: text


@pytest.mark.parametrize("form, good, bad", [
    ({"type": "grammar", "syntax": "regex", "definition": "[0-9]{3}-[a-z]+"}, "123-abc", "12-abc"),
    ({"type": "text"}, "any text at all\n", "text with </tool_call> inside")])
def test_regex_and_text_formats_and_a_named_free_form_tool(accepts, form, good, bad):
    from exactspec.server.tools import plan_tools

    tools = read_tools([{"type": "custom", "name": "note", "format": form}]).chat
    auto = plan_tools(tools, "auto")
    assert accepts(auto, f"<tool_call>note\n{good}</tool_call>") and not accepts(auto, f"<tool_call>note\n{bad}</tool_call>")
    named = plan_tools(tools, {"type": "function", "function": {"name": "note"}})
    assert json.loads(named.read(good, True)[1][0]["function"]["arguments"]) == {"input": good}
    if form["type"] == "grammar":
        assert accepts(named, good) and not accepts(named, bad)


def test_a_free_form_tool_with_a_bad_grammar_is_a_400_naming_it():
    from exactspec.errors import FieldError
    from exactspec.server.tools import plan_tools

    bad = {"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "lark", "definition": "start: ("}}
    with pytest.raises(FieldError) as e:
        plan_tools(read_tools([bad]).chat, "auto")
    assert e.value.param == "tools[0].format.definition"


def test_an_earlier_free_form_call_is_rendered_raw_as_the_model_writes_it():
    """A later turn's history shows a free-form call the way the model writes one (its raw input), and
    a function call as JSON: the generic format's examples match its grammar."""
    from exactspec.server.history import for_template
    from exactspec.server.tools import plan_tools

    items = [{"type": "message", "role": "user", "content": "edit"},
             {"type": "custom_tool_call", "call_id": "b", "name": "apply_patch", "input": EDIT},
             {"type": "custom_tool_call_output", "call_id": "b", "output": "applied"}]
    plan = plan_tools(read_tools([FUNCTION, CODEX_PATCH]).chat, "auto")
    shown = for_template(input_messages(items), None, plan.custom)
    assert shown[1]["content"] == f"<tool_call>apply_patch\n{EDIT}</tool_call>"
    assert '"arguments"' in for_template(input_messages(items), None)[1]["content"]  # not free-form: JSON
