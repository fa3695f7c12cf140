"""Shared fixtures: tiny preset models built once per session into a temporary cache, and one local Ray
cluster for the whole session.

Markers (pyproject): `long` (over 60 s by nature, the reason next to it), `ray` (needs a Ray cluster; set on every
test that uses `ray_cluster`, and by hand on a test that starts one of its own: the quick tier,
`-m "not slow and not ray"`, starts no Ray), `slow` (over ~10 s on a 2-core CPU), `gpu` (needs CUDA; left out of
the default run). The tests mirror the package layout, so one layer runs alone in seconds: `pytest tests/algos`,
`pytest -m "not slow and not ray"`.
"""

import importlib.util
import os
import uuid
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the `xdist_group` marks into groups
def pytest_collection_modifyitems(config, items):
    xdist = config.pluginmanager.hasplugin("xdist")
    no_vllm = importlib.util.find_spec("vllm") is None  # a `-m` that selects `vllm` tests in .venv: skipped, named
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if no_vllm and item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.skip(reason="needs vLLM: bash scripts/test_vllm.sh"))
        if "ray_cluster" in fixtures:
            item.add_marker(pytest.mark.ray)
        # `-n 2 --dist loadgroup`: one worker holds the session's cluster and runs every test on it, the tests of a
        # Ray asyncflow starts itself first (below), before that worker's cluster is up
        if xdist and ("ray_cluster" in fixtures or "no_ray_running" in fixtures):
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif xdist and not item.get_closest_marker("xdist_group") and shares_module_setup(item):
            # its module's fixtures set up once, on the worker that runs the module's tests
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    # The tests of a Ray that asyncflow itself starts and shuts down (`no_ray_running`) run before the session's
    # cluster is up: once it is, they cannot start their own. Under xdist the `long` tests start next, each on a
    # worker while the other works through the short ones (longest first: the run does not wait on one at its end).
    # A test whose answer is computed in the background (tests/test_types.py) runs last: the answer is ready by then.
    items.sort(key=lambda item: (hasattr(getattr(item, "module", None), "start_in_background"),
                                 "no_ray_running" not in getattr(item, "fixturenames", ()),
                                 not (xdist and item.get_closest_marker("long"))))


def pytest_ignore_collect(collection_path, config):
    """`-m vllm` (scripts/test_vllm.sh) collects only the test modules that name vLLM: importing the others only to
    deselect their tests cost each worker ~3 s of CPU."""
    if config.option.markexpr == "vllm" and collection_path.match("test_*.py"):
        return "vllm" not in collection_path.read_text() or None
    return None


def shares_module_setup(item) -> bool:
    """Whether `item` uses a fixture of module or class scope defined in its own module (a model trained, a server
    or an engine started once for the module): under xdist the module then runs on one worker, else each worker
    that takes one of its tests sets the fixture up again."""
    module = item.nodeid.split("::")[0]
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(
        defs[-1].scope in ("module", "class") and defs[-1].baseid.split("::")[0] == module
        for defs in info.name2fixturedefs.values()
    )


def pytest_configure(config):
    """`--dist loadgroup` groups tests by the `@group` xdist writes into their node ids, which pytest >= 9.2 no longer
    lets it change (pytest-xdist#1386): the groups would group nothing, each worker starting its own Ray cluster and
    setting module fixtures up again, with no error. Such a run stops here, naming the fix."""
    if config.getoption("dist", "no") == "loadgroup" and pytest.version_tuple[:2] >= (9, 2):
        raise pytest.UsageError(f"pytest {pytest.__version__} leaves `--dist loadgroup` grouping nothing "
                                "(pytest-xdist#1386): install the test extra's pytest, `pip install 'pytest<9.2'`")


def pytest_collection_finish(session):
    """A selected test module's `start_in_background(run_id, start)` is called once collection ends
    (tests/test_types.py: mypy at the lowest priority, ~90 s of one core on a cold cache, on the CPU the tests before
    it leave idle). Under xdist every worker collects every module: the first one starts the work, all of them learn
    where its answer will lie (`run_id`: the run's, shared by its workers). Not for `--collect-only`."""
    if session.config.option.collectonly:
        return
    worker = getattr(session.config, "workerinput", None)
    run_id = worker["testrunuid"] if worker else uuid.uuid4().hex
    for module in {item.module for item in session.items if getattr(item, "module", None) is not None}:
        if hasattr(module, "start_in_background"):
            module.start_in_background(run_id, start=worker is None or worker["workerid"] == "gw0")


@pytest.fixture(scope="session")
def ray_cluster(_isolated_cache):
    """A local 2-CPU Ray cluster shared by every test that asks for it. Its workers import `src` and every
    test folder (actors unpickle functions defined in test modules); runtimes join it instead of starting
    their own. Its workers run at normal priority, as those of a cluster asyncflow starts (Ray's default, nice 15,
    left a vLLM replica ~3% of a core beside two busy processes: one test took 580 s instead of 27)."""
    ray = pytest.importorskip("ray")
    folders = [SRC, TESTS, *sorted(p for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))]
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*map(str, folders), *([saved] if saved else [])])  # workers inherit
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    os.environ["ASYNCFLOW_CACHE"] = str(tmp_path_factory.mktemp("asyncflow-cache"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    yield


@pytest.fixture(scope="session")
def tiny_llama_path(_isolated_cache):
    from asyncflow.models.loading import resolve_model_path

    return resolve_model_path("preset:tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen2_path(_isolated_cache):
    from asyncflow.models.loading import resolve_model_path

    return resolve_model_path("preset:tiny-qwen2")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from threads; on a shared CPU oversubscribed OpenMP threads make them 10x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
