"""The replica router over real engine services (tiny Llama): a session stays on its replica, sessions spread, a
draining or stopped replica gets no request and its sessions move, a rolling weight update keeps serving, and
`asyncflow serve --replicas 2` routes a `user`'s requests to one replica through HTTP, with the built-in engine and
with vLLM, whose prefix cache then serves a user's shared prefix (counted in `/metrics`)."""

import threading

import httpx
import pytest

from asyncflow.engines.base import SamplingParams
from asyncflow.engines.service import EngineService, EngineServiceError
from asyncflow.engines.torch_inference import TorchInferenceEngine
from asyncflow.models.loading import load_model
from asyncflow.serving.router import ReplicaRouter

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4)


@pytest.fixture
def router(tiny_llama_path, one_torch_thread):
    services = [EngineService(TorchInferenceEngine(load_model(tiny_llama_path).eval(), max_batch_size=8, seed=r),
                              PARAMS, name=f"replica-{r}") for r in range(3)]
    router = ReplicaRouter(services, max_in_flight=4)
    yield router
    for service in services:
        if service.healthy:
            service.close()


def run(router, session, n=1):
    for future in [router.submit([1, 5, 7], PARAMS, session=session) for _ in range(n)]:
        future.result(timeout=60)


def test_a_session_stays_on_its_replica_and_sessions_spread(router):
    for session in ("a", "b", "c"):
        run(router, session)
    pins = {s: router._pins[s] for s in "abc"}
    assert sorted(pins.values()) == [0, 1, 2]  # three new sessions on three idle replicas
    before = list(router.served)
    for _ in range(3):
        run(router, "b")
    grown = [after - b for after, b in zip(router.served, before)]
    assert grown[pins["b"]] == 3 and sum(grown) == 3 and router.affinity_hits == 3
    assert router.in_flight == [0, 0, 0]


def test_a_draining_or_stopped_replica_gets_nothing_and_its_sessions_move(router):
    run(router, "a")
    home = router._pins["a"]
    router.drain(home)
    before = router.served[home]
    run(router, "a", n=3)
    assert router.served[home] == before and router._pins["a"] != home and router.affinity_moves == 1
    router.resume(home)
    moved_to = router._pins["a"]
    router.replicas[moved_to].close()
    run(router, "a")
    assert router._pins["a"] != moved_to and router.healthy
    for i in range(len(router.replicas)):
        router.drain(i)
    with pytest.raises(EngineServiceError, match="no replica can take a request"):
        router.submit([1, 2], PARAMS, session="a")


def test_a_busy_replica_sends_new_requests_elsewhere(router):
    run(router, "a")
    home = router._pins["a"]
    router.in_flight[home] = router.max_in_flight  # as if its slots were taken
    run(router, "a")
    assert router._pins["a"] != home
    router.in_flight[home] = 0


def test_a_rolling_update_keeps_serving_and_every_replica_ends_on_the_new_version(router):
    weights = {k: v.clone() for k, v in router.replicas[0].engine.model.state_dict().items()}
    stop = threading.Event()
    versions = []

    def traffic():
        while not stop.is_set():
            versions.append(router.submit([1, 5], PARAMS, session=None).result(timeout=60).weight_version)

    thread = threading.Thread(target=traffic)
    thread.start()
    router.update_weights(weights, 1, timeout=60)
    stop.set()
    thread.join(60)
    assert [r.engine.weight_version for r in router.replicas] == [1, 1, 1]
    assert versions and set(versions) <= {0, 1}
    assert not router._draining


def test_serve_with_two_replicas_keeps_a_users_requests_on_one(tiny_llama_path, one_torch_thread):
    pytest.importorskip("fastapi")
    from server_fixture import KEY, NAME, running_server

    with running_server(tiny_llama_path, "", replicas=2) as (thread, service, _):
        assert isinstance(service, ReplicaRouter)
        headers = {"Authorization": f"Bearer {KEY}"}
        for user in ("alice", "bob", "alice", "alice", "bob"):
            response = httpx.post(thread.url + "/v1/completions", headers=headers, timeout=60,
                                  json={"model": NAME, "prompt": "12+34=", "max_tokens": 3, "user": user})
            assert response.status_code == 200, response.text
        assert sorted(service.served) == [2, 3] and service._pins["alice"] != service._pins["bob"]
        assert httpx.get(thread.url + "/health", timeout=30).json()["status"] == "ok"


# Over 60 s on 2 cores (~65 s in CI): `build_app` starts the two vLLM engines one after the other (~25 s each on CPU).
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_serve_with_two_vllm_replicas_keeps_a_user_on_the_replica_holding_their_prefix(tiny_llama_path,
                                                                                          one_torch_thread):
    from server_fixture import KEY, NAME, running_server

    def cached_tokens(url: str) -> float:
        scrape = httpx.get(url + "/metrics", headers=headers, timeout=30).text
        return float(next(line.split()[-1] for line in scrape.splitlines()
                          if line.startswith("asyncflow_serve_prompt_tokens_cached_total")))

    headers = {"Authorization": f"Bearer {KEY}"}
    prefix = {user: "".join(str((i * seed) % 10) for i in range(200)) + "+" for user, seed in (("ann", 7), ("bo", 3))}
    uni = {"distributed_executor_backend": "uni"}  # one process fewer per engine (docs/vllm.md)
    with running_server(tiny_llama_path, "", replicas=2, engine="vllm", engine_options=uni) as (thread, service, _):
        assert isinstance(service, ReplicaRouter)
        for turn, user in enumerate(("ann", "bo", "ann", "bo", "ann")):
            response = httpx.post(thread.url + "/v1/completions", headers=headers, timeout=120, json={
                "model": NAME, "prompt": prefix[user] + str(turn) + "=", "max_tokens": 3, "user": user})
            assert response.status_code == 200, response.text
            if turn == 1:
                assert cached_tokens(thread.url) == 0  # each user's first request: nothing to reuse
        assert sorted(service.served) == [2, 3] and service._pins["ann"] != service._pins["bo"]
        assert cached_tokens(thread.url) >= 3 * 128  # the later turns found their 200-token prefix, in whole blocks
