"""Serving a policy over HTTP: an OpenAI-compatible API (`api`), its uvicorn runner (`server`) and the
episodes it records for training agents (`episodes`). Only `api` and `server` import the HTTP stack
(FastAPI, uvicorn: the `serve` extra); `episodes` is plain Python."""
