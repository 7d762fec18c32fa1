"""Tool-call parsers chosen by the chat template (``arbor.models.tool_calls``): parse/format round trips,
malformed calls as errors, several calls, content around calls, the streaming hold-back, and
``format_call`` equal to what the real templates (built-in, Qwen2.5, Llama 3.1) render."""

import json
import re

import pytest

from arbor.models.tokenizer import CHATML_TEMPLATE, Tokenizer, builtin_tokenizer
from arbor.models.tool_calls import (HermesParser, Llama3JsonParser, ToolCall, parser_for, parser_for_template)

# ChatML without tools (the built-in template before it took tools): reads no `tools` variable.
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2.5-Instruct's chat template (tokenizer_config.json), as published.
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Llama-3.1-Instruct's chat template (tokenizer_config.json), as published.
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ARGS = {"city": "Paris", "days": [1, 2], "opts": {"unit": "C", "exact": True}}
HERMES, COMPACT, LLAMA = HermesParser(), HermesParser(compact=True), Llama3JsonParser()


def calls(turn):
    return [(c.name, c.arguments) for c in turn.calls]


@pytest.mark.parametrize("parser", [HERMES, COMPACT, LLAMA], ids=repr)
def test_format_then_parse_round_trips(parser):
    text = parser.format_call("get_weather", ARGS)
    assert text.startswith(parser.call_start("get_weather")) and parser.call_start("x").startswith(parser.call_prefix)
    turn = parser.parse(text)
    assert calls(turn) == [("get_weather", ARGS)] and turn.content == "" and turn.errors == []
    assert turn.calls[0].id.startswith("call_") and turn.calls[0].id != parser.parse(text).calls[0].id
    assert json.loads(turn.calls[0].openai()["function"]["arguments"]) == ARGS


def test_hermes_reads_whitespace_several_calls_and_content():
    text = ('Let me look.\n<tool_call>\n  {"name": "a", "arguments": {"x": 1}}  \n</tool_call>\n'
            '<tool_call>{"name":"b","arguments":{}}</tool_call> done')
    turn = HERMES.parse(text)
    assert calls(turn) == [("a", {"x": 1}), ("b", {})] and turn.errors == []
    assert turn.content == "Let me look.\n\n done"
    assert HERMES.parse("no calls here ") == type(turn)("no calls here", [], [])


@pytest.mark.parametrize("body, problem", [
    ('{"name": "a", "arguments": {"x": 1}', "malformed JSON"),
    ('["a"]', "got a JSON list"),
    ('{"arguments": {}}', 'no "name" string'),
    ('{"name": "a", "arguments": "{\\"x\\": 1}"}', '"arguments" must be a JSON object, got a JSON str'),
])
def test_hermes_malformed_calls_are_errors_not_exceptions(body, problem):
    text = f'<tool_call>{body}</tool_call><tool_call>{{"name": "ok", "arguments": {{}}}}</tool_call>'
    turn = HERMES.parse(text)
    assert calls(turn) == [("ok", {})] and len(turn.errors) == 1
    assert turn.errors[0].startswith("call 1") and problem in turn.errors[0], turn.errors


def test_hermes_unterminated_call():
    assert calls(HERMES.parse('<tool_call>{"name": "a", "arguments": {}}')) == [("a", {})]
    turn = HERMES.parse('<tool_call>{"name": "a", "argu')
    assert turn.calls == [] and "no closing </tool_call>" in turn.errors[0]


def test_llama3_json_calls():
    one = LLAMA.parse('{"name": "a", "parameters": {"x": 1}}')
    assert calls(one) == [("a", {"x": 1})] and one.content == ""
    tagged = LLAMA.parse('Sure. <|python_tag|>{"name": "a", "arguments": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert calls(tagged) == [("a", {"x": 1}), ("b", {})] and tagged.content == "Sure."
    assert LLAMA.parse("It is sunny {ish}.") == type(one)("It is sunny {ish}.", [], [])
    bad = LLAMA.parse('<|python_tag|>{"name": "a", "parameters": [1]}; {"name": ')
    assert bad.calls == [] and len(bad.errors) == 2
    assert '"parameters" must be a JSON object' in bad.errors[0] and "malformed JSON" in bad.errors[1]
    assert LLAMA.parse('<|python_tag|>{"parameters": {}}').errors[0].startswith('call 1: no "name"')


@pytest.mark.parametrize("parser, text, end", [
    (HERMES, "Hello <tool_call>{", 6), (HERMES, "Hello <tool_", 6), (HERMES, "Hello <", 6), (HERMES, "a < b", 5),
    (LLAMA, 'Hi {"na', 3), (LLAMA, "Hi { \"name\" : 1", 3), (LLAMA, "Hi {x", 5), (LLAMA, "Hi <|pyth", 3),
    (LLAMA, "x <|python_tag|>", 2),
])
def test_content_end_holds_back_call_markup(parser, text, end):
    assert parser.content_end(text) == end


def test_parser_chosen_from_the_template():
    assert repr(parser_for(builtin_tokenizer())) == "HermesParser(compact=True)"
    assert repr(parser_for_template(QWEN25_TEMPLATE)) == "HermesParser(compact=False)"
    assert repr(parser_for_template(LLAMA31_TEMPLATE)) == "Llama3JsonParser()"
    assert parser_for_template(PLAIN_TEMPLATE) is None and parser_for_template(None) is None
    with pytest.raises(ValueError, match="known formats: hermes .*; llama3_json"):
        parser_for_template("{% for t in tools %}{{ t | tojson }}{% endfor %}[CALLS]")


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, QWEN25_TEMPLATE, LLAMA31_TEMPLATE], ids=["builtin", "qwen2.5", "llama3.1"])
def test_format_call_is_what_the_template_renders(template):
    tok = Tokenizer(builtin_tokenizer().tok, chat_template=template)
    parser = parser_for(tok)
    user = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
    with_call = tok.apply_chat_template(user + [{"role": "assistant", "content": "", "tool_calls": [call]}],
                                        tools=[WEATHER], tokenize=False)
    prompt = tok.apply_chat_template(user, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert parser.format_call("get_weather", ARGS) in with_call
    turn = re.split(r"<\|im_end\|>|<\|eot_id\|>", with_call.rsplit("assistant", 1)[1])[0]
    assert calls(parser.parse(turn.removeprefix("<|end_header_id|>"))) == [("get_weather", ARGS)]
    assert prompt.startswith(with_call[:with_call.rindex("assistant")])


def test_tool_call_dataclass():
    c = ToolCall("f", {"a": "é"})
    assert c.openai() == {"id": c.id, "type": "function", "function": {"name": "f", "arguments": '{"a": "é"}'}}
