"""OpenAI tool calling through `asyncflow serve`, with the real `openai` client: `tools` rendered by a Hermes-style chat
template, the model's `<tool_call>` text parsed into `tool_calls` (plain and streamed), a malformed call returned as
text, `tool_choice`, 400s naming the field, a `role: tool` follow-up, and an episode's trained ids equal to the ids
sampled across a tool-calling turn.

The model is `preset:tiny-llama-tools` (its vocabulary holds the tool-call pieces as tokens) trained for a few seconds
to answer three prompts with fixed texts, so every reply here is text the model really generated (greedy)."""

import functools
import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_fixture import KEY, NAME, running_server  # noqa: E402

from asyncflow.serving.episodes import episode_row  # noqa: E402

# Hermes-style, on one line: the character vocabulary of the presets has no newline.
TOOLS_TEMPLATE = (
    "{% if tools %}<s>system: Tools:<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools></s>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<s>assistant: {{ m.content or '' }}"
    "{% for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}</s>"
    "{% elif m.role == 'tool' %}<s>tool: <tool_response>{{ m.content }}</tool_response></s>"
    "{% else %}<s>{{ m.role }}: {{ m.content }}</s>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}")
PLAIN_TEMPLATE = ("{% for m in messages %}<s>{{ m.role }}: {{ m.content }}</s>{% endfor %}"
                  "{% if add_generation_prompt %}<s>assistant: {% endif %}")
CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
TOOLS = [CALCULATOR]
CALL = '<tool_call>{"name":"calculator","arguments":{"expression":"2+3"}}</tool_call>'
REPLIES = {  # user message -> what the model is trained to answer (with TOOLS rendered)
    "call": "Sure." + CALL,
    "bad": '<tool_call>{"name":"calculator","arguments":{"expression":"2+3"</tool_call>',
    "plain": "Five.",
}


def train_replies(weights, steps: int = 120) -> None:
    """Teach the model REPLIES (greedy decoding then gives them back) in a few seconds on one CPU thread."""
    import torch

    tokenizer, model = weights.tokenizer, weights.model
    batch = []
    for user, reply in REPLIES.items():
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": user}], tools=TOOLS,
                                               chat_template=TOOLS_TEMPLATE, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        batch.append((prompt_ids, reply_ids))
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = 0
        for prompt_ids, reply_ids in batch:
            logits = model(torch.tensor([prompt_ids + reply_ids])).logits[0, len(prompt_ids) - 1 : -1]
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(reply_ids))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


@pytest.fixture(scope="module")
def server(one_torch_thread):
    with running_server("preset:tiny-llama-tools", TOOLS_TEMPLATE, prepare_weights=train_replies) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@functools.cache
def tools_tokenizer():
    from asyncflow.models.loading import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path("preset:tiny-llama-tools"))


def decode(ids: list[int]) -> str:
    """The text of `ids`, special tokens included."""
    return tools_tokenizer().decode(ids)


def ask(client, user: str, **fields):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": user}],
                                          **{"temperature": 0, "max_tokens": 40, **fields})


@pytest.mark.slow
def test_tools_are_rendered_and_a_call_is_parsed_into_tool_calls(client):
    out = ask(client, "call", tools=TOOLS)
    choice = out.choices[0]
    prompt = decode(choice.prompt_token_ids)
    assert prompt == f"<s>system: Tools:<tools>{json.dumps(CALCULATOR)}</tools></s><s>user: call</s><s>assistant: "
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "2+3"}
    # the ids are the ones sampled: they decode to the model's whole text, call included
    assert decode(choice.token_ids) == REPLIES["call"] + "</s>"


@pytest.mark.slow
def test_streaming_sends_the_call_as_delta_tool_calls_and_the_same_ids(client):
    whole = ask(client, "call", tools=TOOLS).choices[0]
    chunks = list(ask(client, "call", tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Sure."  # the call's text is never streamed as content
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.index, tc.type, tc.function.name) for tc in calls] == [(0, "function", "calculator")]
    assert calls[0].id.startswith("call_") and json.loads(calls[0].function.arguments) == {"expression": "2+3"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    streamed_ids = [i for c in chunks if c.choices for i in (getattr(c.choices[0], "token_ids", None) or [])]
    assert streamed_ids == whole.token_ids


@pytest.mark.slow
def test_a_malformed_call_comes_back_as_text(client):
    for stream in (False, True):
        if stream:
            chunks = list(ask(client, "bad", tools=TOOLS, stream=True))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = ask(client, "bad", tools=TOOLS).choices[0]
            assert choice.message.tool_calls is None
            content, finish = choice.message.content, choice.finish_reason
        assert content == REPLIES["bad"] and finish == "stop"


@pytest.mark.slow
def test_tool_choice_none_renders_and_parses_no_tools(client):
    choice = ask(client, "call", tools=TOOLS, tool_choice="none").choices[0]
    assert not decode(choice.prompt_token_ids).startswith("<s>system: Tools")
    assert choice.message.tool_calls is None and choice.finish_reason != "tool_calls"


@pytest.mark.slow
def test_required_and_named_choices_parse_calls_and_return_text_when_there_is_none(client):
    named = {"type": "function", "function": {"name": "calculator"}}
    for tool_choice in ("required", named):
        called = ask(client, "call", tools=TOOLS, tool_choice=tool_choice).choices[0]
        assert called.message.tool_calls[0].function.name == "calculator"
        # no constrained decoding: a model that answers without a call gets its text back (docs/serving.md)
        plain = ask(client, "plain", tools=TOOLS, tool_choice=tool_choice).choices[0]
        assert plain.message.content == "Five." and plain.message.tool_calls is None
        assert plain.finish_reason == "stop"


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]}, "tools.0.function.colour"),
    ({"tools": [CALCULATOR, CALCULATOR]}, "tools"),
    ({"tools": []}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "python"}}}, "tool_choice"),
])
@pytest.mark.slow
def test_bad_tools_and_tool_choice_get_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, "call", **fields)
    error = caught.value.body
    assert error["param"] == param or error["param"].startswith(param), error
    assert param.split(".")[0] in error["message"]


@pytest.mark.slow
def test_a_role_tool_follow_up_renders_the_call_and_the_result(client):
    first = ask(client, "call", tools=TOOLS).choices[0].message
    messages = [{"role": "user", "content": "call"},
                {"role": "assistant", "content": first.content,
                 "tool_calls": [call.model_dump() for call in first.tool_calls]},
                {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "5"}]
    out = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, temperature=0, max_tokens=4)
    prompt = decode(out.choices[0].prompt_token_ids)
    # outside an episode the template renders the call (arguments as a JSON object, not OpenAI's string)
    assert prompt.endswith('<s>assistant: Sure.<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}'
                           "</tool_call></s><s>tool: <tool_response>5</tool_response></s><s>assistant: ")
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_template_without_tools_is_a_400_not_a_silent_drop(tiny_llama_path, one_torch_thread):
    with running_server(tiny_llama_path, PLAIN_TEMPLATE) as (thread, _, _):
        plain = openai.OpenAI(base_url=thread.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as caught:
            ask(plain, "call", tools=TOOLS)
        assert caught.value.body["param"] == "tools" and "does not render tools" in caught.value.body["message"]
        assert ask(plain, "call", tools=TOOLS, tool_choice="none", max_tokens=2).choices[0].message.tool_calls is None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.slow
def test_an_episode_trains_the_ids_sampled_for_a_tool_calling_turn(server, stream):
    thread, _, recorder = server
    episode = f"ep-tools-{stream}"
    recorder.open(episode)
    agent = openai.OpenAI(base_url=f"{thread.url}/episodes/{episode}/v1", api_key=KEY, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "call"}]
    if stream:
        chunks = list(agent.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        content = "".join(d.content or "" for d in deltas) or None
        tool_calls = [{"id": tc.id, "type": tc.type, "function": tc.function.model_dump()}
                      for d in deltas for tc in (d.tool_calls or [])]
        first_ids = [i for c in chunks if c.choices for i in (getattr(c.choices[0], "token_ids", None) or [])]
    else:
        first = agent.chat.completions.create(model=NAME, messages=messages, tools=TOOLS).choices[0]
        content, first_ids = first.message.content, first.token_ids
        tool_calls = [call.model_dump() for call in first.message.tool_calls]
    assert [call["function"]["name"] for call in tool_calls] == ["calculator"]
    messages += [{"role": "assistant", "content": content, "tool_calls": tool_calls},
                 {"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": "5"}]
    second = agent.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, max_tokens=8).choices[0]
    calls = recorder.close(episode)
    assert [c.response_ids for c in calls] == [first_ids, second.token_ids]
    # the follow-up's prompt holds the tool-calling turn as the ids sampled, not re-tokenized from `tool_calls`
    assert second.prompt_token_ids[: len(calls[0].prompt_ids) + len(first_ids)] == calls[0].prompt_ids + first_ids
    row = episode_row(calls)
    assert row.calls == 2 and row.dropped_calls == 0
    assert [t for t, m in zip(row.response_ids, row.loss_mask) if m] == first_ids + second.token_ids
    assert row.prompt_ids + row.response_ids == second.prompt_token_ids + second.token_ids


@pytest.mark.slow
def test_an_episode_turn_the_agent_changed_is_rendered_as_given(server):
    thread, _, recorder = server
    recorder.open("ep-changed")
    agent = openai.OpenAI(base_url=f"{thread.url}/episodes/ep-changed/v1", api_key=KEY, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "call"}]
    first = agent.chat.completions.create(model=NAME, messages=messages, tools=TOOLS).choices[0].message
    changed = [call.model_dump() for call in first.tool_calls]
    changed[0]["function"]["arguments"] = json.dumps({"expression": "7*6"})
    messages += [{"role": "assistant", "content": first.content, "tool_calls": changed},
                 {"role": "tool", "tool_call_id": changed[0]["id"], "content": "42"}]
    second = agent.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, max_tokens=2).choices[0]
    assert '{"expression": "7*6"}' in decode(second.prompt_token_ids)
    row = episode_row(recorder.close("ep-changed"))
    assert row.calls == 1 and row.dropped_calls == 1  # history rewritten: not trained, never re-tokenized


def test_a_turn_is_split_into_the_text_outside_its_calls_and_the_calls_in_order():
    from asyncflow.serving.tool_calling import parse_turn

    two = ('Let me see. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
           '<tool_call>{"name": "b"}</tool_call>')
    turn = parse_turn(two, "hermes")
    assert turn.content == "Let me see.  and "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in turn.tool_calls] == [
        ("a", {"x": 1}), ("b", {})]
    assert len(set(turn.call_ids)) == 2 and all(i.startswith("call_") for i in turn.call_ids)
    assert parse_turn(" " + CALL + " ", "hermes").content is None  # only whitespace outside: null content
    for malformed in (CALL[:-3], "<tool_call>[1]</tool_call>", '<tool_call>{"name": "a", "arguments": 3}</tool_call>'):
        assert parse_turn(malformed, "hermes").tool_calls == [] and parse_turn(malformed, "hermes").content == malformed


def test_a_stream_holds_the_text_from_a_call_on_also_past_a_stop_string():
    from asyncflow.serving.api import TextStream

    tokenizer = tools_tokenizer()
    ids = tokenizer("Hi <tool_call>{}</tool_call> END more", add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, ["END"], hold_from="<tool_call>")
    sent = "".join(stream.add([i], [0.0])[0] for i in ids)
    assert sent == "Hi " and stream.stopped  # the text before the stop string is final: its space goes out too
    plain = TextStream(tokenizer, ["END"])
    assert "".join(plain.add([i], [0.0])[0] for i in ids) == "Hi <tool_call>{}</tool_call> "
