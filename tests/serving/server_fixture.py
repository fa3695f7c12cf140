"""The OpenAI-compatible server on a free local port, as the serving tests start it (imported by them)."""

from __future__ import annotations

from contextlib import contextmanager

KEY = "test-key"
NAME = "tiny"


@contextmanager
def running_server(model_path, chat_template: str):
    """(server thread, engine service, episode recorder) of `asyncflow serve MODEL` with `KEY` and `NAME`."""
    from asyncflow.serving.episodes import EpisodeRecorder
    from asyncflow.serving.server import ServerThread
    from asyncflow.workflow.serve import build_app, load_served

    recorder = EpisodeRecorder()
    app, service = build_app(load_served(str(model_path)), api_key=KEY, name=NAME, chat_template=chat_template,
                             request_timeout_s=60, recorder=recorder)
    thread = ServerThread(app).start()
    try:
        yield thread, service, recorder
    finally:
        thread.stop()
        service.close()
