"""The OpenAI-compatible server on a free local port, as the serving tests start it (imported by them)."""

from __future__ import annotations

from contextlib import contextmanager

KEY = "test-key"
NAME = "tiny"
TEMPLATE = ("{% for m in messages %}<s>{{ m.role }}: {{ m.content }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")


@contextmanager
def running_server(model_path, chat_template: str, *, limits=None, tokenizer_wrapper=None, prepare_weights=None,
                   replicas: int = 1, engine: str = "torch", engine_options=None):
    """(server thread, engine service, episode recorder) of `asyncflow serve MODEL` with `KEY` and `NAME`
    (`limits`: its `ServingLimits`; `tokenizer_wrapper(tokenizer)`: what the server tokenizes with;
    `prepare_weights(weights)`: run on the loaded `ServedWeights` before serving, e.g. a few training steps;
    `replicas`: engines behind the router; `engine`: their kind, `engine_options` their factory's options)."""
    from asyncflow.serving.episodes import EpisodeRecorder
    from asyncflow.serving.server import ServerThread
    from asyncflow.workflow.serve import build_app, load_served

    recorder = EpisodeRecorder()
    weights = load_served(str(model_path))
    if prepare_weights is not None:
        prepare_weights(weights)
    if tokenizer_wrapper is not None:
        weights.tokenizer = tokenizer_wrapper(weights.tokenizer)
    extra = {} if limits is None else {"limits": limits}
    app, service = build_app(weights, api_key=KEY, name=NAME, chat_template=chat_template, request_timeout_s=60,
                             recorder=recorder, replicas=replicas, engine=engine,
                             engine_options=engine_options, **extra)
    thread = ServerThread(app, **extra).start()
    try:
        yield thread, service, recorder
    finally:
        thread.stop()
        service.close()
