"""OpenAI tool calling through `arbor serve`, with the official `openai` client over real HTTP.

The served model is tiny with hand-set weights that make it a bigram model on a few characters
(':' → '{', '{' → '}', '}' → '}', '\\n' → 'O', 'O' → 'K', 'K' → end of turn), so greedy decoding is known:
a call forced with tool_choice continues ``…"arguments":`` with ``{}}`` (a well-formed call at
max_tokens=3, a malformed one at 2), and a plain answer is ``OK``. A second server's template takes no
tools. The response reading is also checked on fabricated texts, for both call formats."""

import json

import openai
import pytest
import torch
from openai.lib.streaming.chat import ChatCompletionStreamState

from arbor.engine import EngineConfig
from arbor.engine.sequence import Completion
from arbor.engine.threaded_engine import ThreadedAsyncLLMEngine
from arbor.models import CausalLM, ModelConfig, save_model
from arbor.models.tokenizer import Tokenizer, builtin_tokenizer
from arbor.models.tool_calls import HermesParser, Llama3JsonParser
from arbor.serve import openai_protocol as oai
from arbor.serve.server import build_app
from arbor.serve.tool_calling import ToolPlan, ToolStream, tool_plan
from tests.server_helpers import running, tiny_folder
from tests.test_tool_calls import LLAMA31_TEMPLATE, PLAIN_TEMPLATE

BIGRAMS = {":": "{", "{": "}", "}": "}", "\n": "O", "O": "K", "K": "<|im_end|>"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
FORCE = {"type": "function", "function": {"name": "get_weather"}}


def bigram_folder(folder):
    """The tiny model of the module docstring: layers write nothing to the residual stream, so the logits
    depend on the last token only; ``BIGRAMS`` is its greedy next token for a few tokens."""
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, head_dim=8,
                                 eos_token_id=tok.eos_token_id)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        model.model.norm.weight.fill_(1.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head[:, :len(BIGRAMS)] = 0
        for k, (a, b) in enumerate(BIGRAMS.items()):
            embed[tok.token_id(a)] = 0
            embed[tok.token_id(a), k] = 1.0
            head[tok.token_id(b), k] = 10.0
    save_model(model, folder, tokenizer=tok)
    return folder


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tools_dir = bigram_folder(tmp_path_factory.mktemp("served") / "bigram")
    plain_dir = tiny_folder(tmp_path_factory.mktemp("served") / "plain")
    Tokenizer(builtin_tokenizer().tok, chat_template=PLAIN_TEMPLATE).save(plain_dir)
    cfg = EngineConfig(max_model_len=256)
    engines = [ThreadedAsyncLLMEngine(str(d), cfg) for d in (tools_dir, plain_dir)]
    with running(build_app(engines[0], "tiny")) as url, running(build_app(engines[1], "plain")) as plain_url:
        yield (openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0),
               openai.OpenAI(base_url=plain_url + "/v1", api_key="none", max_retries=0))
    torch.set_num_threads(threads)


def ask(client, **kw):
    return client.chat.completions.create(**{"model": "tiny", "messages": ASK, "tools": [WEATHER, TIME],
                                             "temperature": 0, "max_tokens": 3, **kw})


def prompt_tokens(messages, tools, forced=""):
    tok = builtin_tokenizer()
    return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  tools=tools) + forced))


def test_forced_call_then_the_tool_result(clients):
    client, _ = clients
    r = ask(client, tool_choice=FORCE)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {}
    forced = HermesParser(compact=True).call_start("get_weather")
    assert r.usage.prompt_tokens == prompt_tokens(ASK, [WEATHER, TIME], forced)
    # the OpenAI tool-calling loop: the assistant's call and the tool's result go back
    history = ASK + [c.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r2 = ask(client, messages=history, max_tokens=8)
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.content == "OK"
    assert r2.choices[0].message.tool_calls is None
    rendered = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
                      {"role": "tool", "content": "sunny, 21 C"}]
    assert r2.usage.prompt_tokens == prompt_tokens(rendered, [WEATHER, TIME])


def test_malformed_forced_call_comes_back_as_text(clients):
    client, _ = clients
    c = ask(client, tool_choice=FORCE, max_tokens=2).choices[0]       # '{}': the call's object is not closed
    assert c.finish_reason == "length" and c.message.tool_calls is None
    assert c.message.content == '<tool_call>{"name":"get_weather","arguments":{}'


def test_streamed_forced_call_accumulates_to_the_same_call(clients):
    client, _ = clients
    state = ChatCompletionStreamState()
    for chunk in ask(client, tool_choice=FORCE, stream=True):
        state.handle_chunk(chunk)
    c = state.get_final_completion().choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content
    (call,) = c.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather" and call.function.arguments == "{}"


def test_auto_and_none_answer_in_text(clients):
    client, _ = clients
    for choice in ("auto", "none", None):
        kw = {} if choice is None else {"tool_choice": choice}
        c = ask(client, max_tokens=8, **kw).choices[0]
        assert (c.finish_reason, c.message.content, c.message.tool_calls) == ("stop", "OK", None), choice
    streamed = "".join(ch.choices[0].delta.content or "" for ch in ask(client, max_tokens=8, stream=True)
                       if ch.choices)
    assert streamed == "OK"


@pytest.mark.parametrize("kw, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_news"}}},
     "'tool_choice' names the function 'get_news', which is not in 'tools' (get_weather, get_time)"),
    ({"tool_choice": "sometimes"}, "'tool_choice' must be \"auto\", \"none\", \"required\" or"),
    ({"tools": [WEATHER, {"type": "function", "function": {"description": "no name"}}]}, "tools[1] must be {"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1] repeats the name 'get_weather'"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0] has the name 'a b'"),
    ({"tools": [], "tool_choice": "required"}, "'tool_choice' is only allowed when 'tools' are given"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris}"}}]}]},
     "messages[1]: the arguments of the call of 'get_weather' are not JSON"),
])
def test_bad_tool_requests_get_400(clients, kw, message):
    client, _ = clients
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, **kw)
    assert e.value.status_code == 400 and message in e.value.body["message"], e.value.body


def test_tools_to_a_model_whose_template_takes_none(clients):
    _, plain = clients
    with pytest.raises(openai.BadRequestError) as e:
        ask(plain, model="plain")
    assert "this model's chat template does not render tools" in e.value.body["message"]
    assert e.value.body["param"] == "tools"
    assert ask(plain, model="plain", tools=openai.omit).choices[0].message.content is not None


def fabricated(text: str, reason: str = "stop") -> Completion:
    return Completion("r", 0, [1], [2, 3], [0.0, 0.0], reason, text)


@pytest.mark.parametrize("parser", [HermesParser(), HermesParser(compact=True), Llama3JsonParser()], ids=repr)
def test_response_reads_calls_exactly(parser):
    plan = ToolPlan([WEATHER], parser)
    text = "Let me check." + parser.format_call("get_weather", {"city": "Paris"})
    c = oai.choice(fabricated(text), 0, True, None, False, plan)
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == "Let me check."
    (call,) = c["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and call["type"] == "function"
    forced = ToolPlan([WEATHER], parser, parser.call_start("get_weather"))
    tail = parser.format_call("get_weather", {"city": "Rome"})[len(forced.forced):]
    c = oai.choice(fabricated(tail, "length"), 0, True, None, False, forced)
    assert c["message"]["content"] is None and c["finish_reason"] == "tool_calls"
    assert json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    broken = oai.choice(fabricated('{"city": Rome}', "stop"), 0, True, None, False, forced)
    assert broken["finish_reason"] == "stop" and "tool_calls" not in broken["message"]
    assert broken["message"]["content"] == forced.forced + '{"city": Rome}'
    half = text + parser.format_call("get_weather", {"city": "Rome"})[:-3]      # a good call and a cut one
    assert oai.choice(fabricated(half), 0, True, None, False, plan)["message"] == {"role": "assistant", "content": half}
    assert oai.choice(fabricated(text), 0, True, None, False, ToolPlan([WEATHER]))["message"] == \
        {"role": "assistant", "content": text}          # tool_choice "none": not parsed


def test_tool_stream_adds_up_to_the_response():
    plan = ToolPlan([WEATHER], HermesParser())
    text = "Checking the weather. " + plan.parser.format_call("get_weather", {"city": "Paris"}) + "\nDone."
    stream, sent = ToolStream(plan), ""
    for end in range(1, len(text)):
        sent += stream.step(text[:end])
    assert sent == "Checking the weather."            # nothing of the call, no trailing space
    deltas, finish = stream.last(text, "stop")
    message, _ = plan.message(text)
    assert finish == "tool_calls" and sent + deltas[0]["content"] == message["content"] == \
        "Checking the weather. \nDone."
    (call,) = deltas[1]["tool_calls"]
    assert call["index"] == 0 and call["function"] == message["tool_calls"][0]["function"]
    plain = ToolStream(plan)
    assert "".join(plain.step("Just text <b>") for _ in range(1)) == "Just text <b>"
    assert plain.last("Just text <b> end", "length") == ([{"content": " end"}], "length")


def test_tool_plan_per_tool_choice():
    tok = builtin_tokenizer()
    body = {"tools": [WEATHER, TIME]}
    auto = tool_plan(body, tok)
    assert repr(auto.parser) == "HermesParser(compact=True)" and auto.forced == "" and auto.tools == [WEATHER, TIME]
    assert tool_plan({**body, "tool_choice": "required"}, tok).forced == '<tool_call>{"name":"'
    assert tool_plan({**body, "tool_choice": FORCE}, tok).forced == '<tool_call>{"name":"get_weather","arguments":'
    none = tool_plan({**body, "tool_choice": "none"}, tok)
    assert none.parser is None and none.tools == [WEATHER, TIME]
    assert tool_plan({"tool_choice": "none"}, tok) == ToolPlan()
    llama = Tokenizer(tok.tok, chat_template=LLAMA31_TEMPLATE)
    assert tool_plan({**body, "tool_choice": FORCE}, llama).forced == '{"name": "get_weather", "parameters": '
    bare = tool_plan({"tools": [{"type": "function", "function": {"name": "ping"}}]}, tok).tools
    assert bare == [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object",
                                                                                     "properties": {}}}}]
