"""Chat templates in the tool layouts of five families (server/families.py), written for these tests from
each family's documented format -- how the tools are shown, how an assistant's calls and the tools'
results are laid out -- not copied from any model's template. Rendered with transformers' settings
(trim_blocks, lstrip_blocks)."""

# Qwen 2.5 / Hermes: the tools as JSON lines inside <tools></tools> in the system turn; calls as
# <tool_call>\n{json}\n</tool_call>; results as <tool_response> blocks in a user turn.
HERMES = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within ' }}
{{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}' }}
{{- '\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}
{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (m.content or '') }}
{%- for call in m.tool_calls or [] %}
{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Llama 3.1 / 3.2 (JSON tool calling): the tools, with the instruction to answer with
# {"name": ..., "parameters": ...}, go at the top of the first user turn; results are `ipython` turns.
LLAMA3 = """\
{{- bos_token if bos_token else '' }}
{%- for m in messages %}
{%- if m.role == 'user' and tools and loop.first %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON for a ' }}
{{- 'function call with its proper arguments that best answers the given prompt.\\n\\nRespond in the format ' }}
{{- '{"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}
{%- for tool in tools %}{{- (tool | tojson(indent=4)) + '\\n\\n' }}{%- endfor %}
{{- m.content + '<|eot_id|>' }}
{%- elif m.role == 'assistant' and m.tool_calls %}
{%- for call in m.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + call.function.name + '", "parameters": ' }}
{{- (call.function.arguments | tojson) + '}<|eot_id|>' }}
{%- endfor %}
{%- elif m.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

# Mistral (v3 layout): the tools as one JSON list in [AVAILABLE_TOOLS] before the last user turn;
# calls as [TOOL_CALLS] [{...}, ...] with 9-character ids; results in [TOOL_RESULTS].
MISTRAL = """\
{%- set ns = namespace(last_user=0) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{{- bos_token if bos_token else '' }}
{%- for m in messages %}
{%- if m.role == 'user' %}
{%- if tools and loop.index0 == ns.last_user %}
{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{{- '[INST] ' + m.content + '[/INST]' }}
{%- elif m.role == 'assistant' and m.tool_calls %}
{{- '[TOOL_CALLS] [' }}
{%- for call in m.tool_calls %}
{%- if call.id | length != 9 %}{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9') }}{%- endif %}
{{- '{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + ', "id": "' + call.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + (eos_token or '') }}
{%- elif m.role == 'assistant' %}
{{- m.content + (eos_token or '') }}
{%- elif m.role == 'tool' %}
{{- '[TOOL_RESULTS] {"content": ' + (m.content | tojson) + ', "call_id": "' + m.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}
"""

# Granite 3.x: the tools in an `available_tools` turn; calls as <|tool_call|>[{...}, ...]; results in
# `tool_response` turns.
GRANITE = """\
{%- if tools %}
{{- '<|start_of_role|>available_tools<|end_of_role|>\\n' + (tools | tojson(indent=4)) + '<|end_of_text|>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}
{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>[' }}
{%- for call in m.tool_calls %}
{{- '{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}' }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']<|end_of_text|>\\n' }}
{%- elif m.role == 'tool' %}
{{- '<|start_of_role|>tool_response<|end_of_role|>' + m.content + '<|end_of_text|>\\n' }}
{%- else %}
{{- '<|start_of_role|>' + m.role + '<|end_of_role|>' + m.content + '<|end_of_text|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}
"""

# Qwen3-Coder: the tools as XML inside <tools></tools> in the system turn; calls as XML blocks
# <tool_call>\n<function=N>\n<parameter=K>\nV\n</parameter>\n</function>\n</tool_call> (strings as
# themselves, other values as JSON); results as <tool_response> blocks in a user turn.
QWEN3_CODER = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n<function>\\n<name>' + tool.function.name + '</name>' }}
{%- if tool.function.description %}{{- '\\n<description>' + tool.function.description + '</description>' }}{%- endif %}
{{- '\\n<parameters>' }}
{%- for key, param in (tool.function.parameters.properties or {}).items() %}
{{- '\\n<parameter>\\n<name>' + key + '</name>' }}
{%- if param.type %}{{- '\\n<type>' + param.type + '</type>' }}{%- endif %}
{{- '\\n</parameter>' }}
{%- endfor %}
{{- '\\n</parameters>\\n</function>' }}
{%- endfor %}
{{- '\\n</tools>\\n\\nTo call a function, reply with <tool_call> blocks only.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}
{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (m.content or '') }}
{%- for call in m.tool_calls or [] %}
{{- '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' }}
{%- for key, value in call.function.arguments.items() %}
{{- '<parameter=' + key + '>\\n' }}
{%- if value is string %}{{- value }}{%- else %}{{- value | tojson }}{%- endif %}
{{- '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

TEMPLATES = {"hermes": HERMES, "llama3_json": LLAMA3, "mistral": MISTRAL, "granite": GRANITE,
             "qwen3_coder": QWEN3_CODER}
