"""Token-by-token streaming in the OpenAI-compatible server, read with the real `openai` client: streamed pieces
concatenate to the non-streamed response (completions and chat, n=2, a stop string across tokens), the first
chunk leaves while the engine is still generating, failures after the start end the stream with an error event,
a client that goes away hurts no one, an engine that cannot stream still streams (a choice at a time), episodes
record streamed calls; `TextStream` never splits a multi-byte character."""

import dataclasses
import threading

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_fixture import KEY, NAME, running_server

from asyncflow.engines.base import SamplingParams
from asyncflow.engines.service import EngineService
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.models.loading import load_model, load_tokenizer
from asyncflow.serving.api import ServedModel, TextStream, make_app
from asyncflow.serving.server import ServerThread

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
PROMPT = "ab"  # the tiny model's greedy continuation changes character after a few tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(tiny_llama_path, one_torch_thread):
    with running_server(tiny_llama_path, TEMPLATE) as running:
        yield running


def client_of(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def spanning_stop(text: str) -> str:
    """Two characters (two tokens of the character tokenizer) where the text first changes character."""
    change = next(i for i in range(1, len(text)) if text[i] != text[i - 1])
    return text[change - 1 : change + 1]


def joined(chunks, kind: str) -> dict[int, dict]:
    """Per choice index: the concatenated text, token ids and log-probs, the finish reasons."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            choice = out.setdefault(c.index, {"text": "", "ids": [], "logprobs": [], "finish": []})
            choice["text"] += (c.delta.content if kind == "chat" else c.text) or ""
            choice["ids"] += getattr(c, "token_ids", None) or []
            choice["logprobs"] += getattr(c, "token_logprobs", None) or []
            choice["finish"].append(c.finish_reason)
            if c.logprobs is not None:  # OpenAI's own field, when asked for
                choice.setdefault("openai_logprobs", []).extend(
                    [t.logprob for t in c.logprobs.content or []] if kind == "chat" else c.logprobs.token_logprobs)
    return out


def assert_streamed_equals_plain(plain_choices, streamed: dict[int, dict], kind: str):
    assert sorted(streamed) == [c.index for c in plain_choices]
    for plain in plain_choices:
        piece = streamed[plain.index]
        assert piece["text"] == (plain.message.content if kind == "chat" else plain.text)
        assert piece["ids"] == plain.token_ids and piece["logprobs"] == plain.token_logprobs
        assert piece["finish"][-1] == plain.finish_reason and not any(piece["finish"][:-1])


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_pieces_concatenate_to_the_plain_response(server, kind):
    client = client_of(server[0].url)
    common = dict(model=NAME, max_tokens=24, temperature=0)
    if kind == "chat":
        create = lambda **kw: client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **kw)
        first = create(**common).choices[0].message.content
    else:
        create = lambda **kw: client.completions.create(prompt=PROMPT, **kw)
        first = create(**common).choices[0].text
    stop = spanning_stop(first)
    plain = create(**common, n=2, stop=[stop, "never"]).choices
    assert plain[0].finish_reason == "stop" and 0 < len(plain[0].token_ids) < 24
    streamed = joined(create(**common, n=2, stop=[stop, "never"], stream=True, logprobs=True if kind == "chat" else 1),
                      kind)
    assert_streamed_equals_plain(plain, streamed, kind)
    assert all(streamed[c.index]["openai_logprobs"] == c.token_logprobs for c in plain)
    whole = create(**common, stream=True, stream_options={"include_usage": True})
    chunks = list(whole)
    assert chunks[-1].usage.completion_tokens == 24 and len(joined(chunks, kind)[0]["ids"]) == 24


def test_an_engine_that_cannot_stream_sends_each_choice_when_finished(server):
    thread, service, _ = server
    client = client_of(thread.url)
    plain = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, n=2).choices
    service.engine.streams_tokens = False
    try:
        assert client.models.list().data[0].streaming == "choice"
        streamed = joined(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, n=2,
                                                    stream=True), "completion")
    finally:
        del service.engine.streams_tokens  # back to the class's True
    assert client.models.list().data[0].streaming == "token"
    for c in plain:
        assert streamed[c.index]["text"] == c.text and streamed[c.index]["ids"] == c.token_ids


def test_a_streamed_episode_call_is_recorded_once_finished(server):
    thread, _, recorder = server
    recorder.open("ep-stream")
    agent = openai.OpenAI(base_url=thread.url + "/episodes/ep-stream/v1", api_key=KEY, max_retries=0, timeout=60)
    streamed = joined(agent.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPT}],
                                                    max_tokens=6, stream=True), "chat")[0]
    [call] = recorder.close("ep-stream")
    assert call.response_ids == streamed["ids"] and call.logprobs == streamed["logprobs"]


class PausedAfterFirstToken:
    """The torch engine whose requests each stop after their first token until `resume` is set (on the engine's
    thread, inside the token callback): whatever the client has read by then left while its request was still
    generating. `delivered` counts the tokens handed to the server."""

    streams_tokens = True

    def __init__(self, engine: TorchInferenceEngine):
        self.engine = engine
        self.resume = threading.Event()
        self.delivered = 0

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def update_weights(self, state_dict, version: int) -> None:
        self.engine.update_weights(state_dict, version)

    def generate(self, requests, params):
        return self.engine.generate((self._paused(r) for r in requests), params)

    def _paused(self, request):
        if request is None or request.on_tokens is None:
            return request
        forward, first = request.on_tokens, [True]

        def on_tokens(ids, logprobs):
            self.delivered += len(ids)
            forward(ids, logprobs)
            if first.pop() if first else False:
                self.resume.wait(30)

        return dataclasses.replace(request, on_tokens=on_tokens)


@pytest.fixture
def paused(tiny_llama_path):
    """(server, engine, service) over a `PausedAfterFirstToken` engine, with a 3 s request timeout."""
    model = load_model(tiny_llama_path).eval()
    engine = PausedAfterFirstToken(TorchInferenceEngine(model, max_batch_size=4))
    service = EngineService(engine, SamplingParams())
    vocab_size = model.get_input_embeddings().num_embeddings
    served = ServedModel(NAME, load_tokenizer(tiny_llama_path), service, 512, vocab_size)
    thread = ServerThread(make_app(served, api_key=KEY, request_timeout_s=3)).start()
    try:
        yield thread, engine, service
    finally:
        engine.resume.set()
        thread.stop()
        service.close()


def test_the_first_chunk_leaves_while_the_engine_is_still_generating(paused):
    thread, engine, _ = paused
    chunks = iter(client_of(thread.url).completions.create(model=NAME, prompt=PROMPT, max_tokens=32, temperature=0,
                                                           stream=True))
    first = next(chunks)
    delivered_when_read = engine.delivered
    engine.resume.set()
    rest = list(chunks)
    assert first.choices[0].token_ids and first.choices[0].finish_reason is None
    total = len(first.choices[0].token_ids) + sum(len(c.choices[0].token_ids or []) for c in rest)
    assert delivered_when_read == 1 < total == 32


@pytest.mark.slow
def test_a_failure_after_the_start_ends_the_stream_with_an_error_event(paused):
    thread, engine, service = paused
    client = client_of(thread.url)
    chunks = iter(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=32, stream=True))
    next(chunks)
    with pytest.raises(openai.APIError) as timed_out:  # the engine waits: the request's 3 s run out
        list(chunks)
    assert timed_out.value.body["type"] == "timeout_error"
    engine.resume.set()

    engine.resume.clear()
    chunks = iter(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=32, stream=True))
    next(chunks)
    service.submit([1, 10_000])  # token ids outside the vocabulary: the engine raises and the loop stops
    engine.resume.set()
    with pytest.raises(openai.APIError) as stopped:
        list(chunks)
    assert stopped.value.body["code"] == "engine_unavailable" and "outside" in stopped.value.message


def test_a_client_that_goes_away_mid_stream_does_not_hurt_other_callers(paused):
    thread, engine, service = paused
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 32, "stream": True}
    with httpx.stream("POST", thread.url + "/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        first = next(response.iter_lines())
    assert first.startswith("data: {")  # the connection is closed after one event
    engine.resume.set()
    out = client_of(thread.url).completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    assert len(out.choices[0].token_ids) == 8 and service._thread.is_alive()


def sentencepiece_like_tokenizer():
    """Words with sentencepiece's "▁" for a space: the decoder drops the space before a text's first word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["▁hello", "▁world", "▁ok", "▁stop", "▁here", "<unk>"]
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def test_text_stream_keeps_the_spaces_of_a_sentencepiece_like_decoder():
    tokenizer = sentencepiece_like_tokenizer()
    ids = tokenizer("hello world ok stop here ok", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6 and tokenizer.decode(ids) == "hello world ok stop here ok"
    stream = TextStream(tokenizer, ["p h"])
    pieces = [stream.add([token], [0.0])[0] for token in ids]
    assert pieces[:3] == ["hello", " world", " ok"] and "".join(pieces) == "hello world ok sto"


def byte_level_tokenizer():
    """A tokenizer of single bytes (no merges): a character of several UTF-8 bytes takes several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.parametrize("stops, expected", [([], "héllo 世界, ok 🙂"), ([", o", "ok!"], "héllo 世界")])
def test_text_stream_never_sends_a_broken_character_nor_a_stop_strings_start(stops, expected):
    tokenizer = byte_level_tokenizer()
    ids = tokenizer("héllo 世界, ok 🙂", add_special_tokens=False)["input_ids"]
    assert len(ids) == len("héllo 世界, ok 🙂".encode())
    stream, pieces, taken = TextStream(tokenizer, stops), [], []
    for token in ids:
        text, new_ids, _ = stream.add([token], [0.0])
        pieces.append(text)
        taken += new_ids
    assert not any("\ufffd" in p for p in pieces) and sum(bool(p) for p in pieces) > 5
    assert "".join(pieces) + stream.rest(expected) == expected
    if stops:  # no token after the one that completed ", o"; nothing of ", " was sent before it
        assert tokenizer.decode(taken) == expected + ", o" and "," not in "".join(pieces)
