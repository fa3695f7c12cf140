"""What token-by-token streaming buys and costs in the OpenAI-compatible server: `clients` concurrent callers each
ask for one completion of `max_tokens` tokens (greedy, no stop), streamed and not, alternating in one invocation,
through the real `openai` client. Prints per mode the mean time to the first token (streamed: the first chunk with
token ids; plain: the whole response) and the whole call, tokens/s over all callers, and the ratios.

    PYTHONPATH=src flock /tmp/asyncflow-bench.lock .venv/bin/python benchmarks/bench_streaming.py
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

KEY = "bench"


def one_call(client, stream: bool, max_tokens: int, out: list) -> None:
    start = time.perf_counter()
    ask = dict(model="bench", prompt="ab", max_tokens=max_tokens, temperature=0, stop=None)
    chunks = 1
    if stream:
        first, tokens, chunks = None, 0, 0
        for chunk in client.completions.create(**ask, stream=True):
            chunks += 1
            for choice in chunk.choices:
                if choice.token_ids and first is None:
                    first = time.perf_counter() - start
                tokens += len(choice.token_ids or [])
    else:
        tokens = len(client.completions.create(**ask).choices[0].token_ids)
        first = time.perf_counter() - start
    out.append((first, time.perf_counter() - start, tokens, chunks))


def round_of(client, clients: int, stream: bool, max_tokens: int) -> tuple[float, float, float, float]:
    """-> (mean time to first token, mean call time, tokens/s over the round, mean chunks per call)."""
    out: list = []
    threads = [threading.Thread(target=one_call, args=(client, stream, max_tokens, out)) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - start
    assert len(out) == clients and all(o[2] == max_tokens for o in out), out
    return (statistics.mean(o[0] for o in out), statistics.mean(o[1] for o in out), clients * max_tokens / wall,
            statistics.mean(o[3] for o in out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="preset:small-llama")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import httpx
    import openai

    from asyncflow.serving.server import ServerThread
    from asyncflow.workflow.serve import build_app, load_served

    weights = load_served(args.model)
    weights.tokenizer.eos_token_id = None  # every call runs to max_tokens: equal work in both modes
    app, service = build_app(weights, api_key=KEY, name="bench", max_batch_size=64)
    thread = ServerThread(app).start()
    client = openai.OpenAI(base_url=thread.url + "/v1", api_key=KEY, max_retries=0, timeout=600,
                           http_client=httpx.Client(limits=httpx.Limits(max_connections=args.clients)))
    try:
        round_of(client, args.clients, True, 8)  # warm-up
        round_of(client, args.clients, False, 8)
        print(f"{args.model}, {args.clients} concurrent callers x {args.max_tokens} tokens, greedy, one torch thread")
        print("| repeat | mode | first token s | whole call s | tok/s | chunks per call | first token / plain call "
              "| tok/s vs plain |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for repeat in range(args.repeats):
            plain = round_of(client, args.clients, False, args.max_tokens)
            streamed = round_of(client, args.clients, True, args.max_tokens)
            print(f"| {repeat} | plain | {plain[0]:.3f} | {plain[1]:.3f} | {plain[2]:.0f} | 1 | 1.00 | 1.00 |")
            print(f"| {repeat} | streamed | {streamed[0]:.3f} | {streamed[1]:.3f} | {streamed[2]:.0f} | "
                  f"{streamed[3]:.0f} | {streamed[0] / plain[1]:.3f} | {streamed[2] / plain[2]:.2f} |")
    finally:
        client.close()
        thread.stop()
        service.close()


if __name__ == "__main__":
    main()
