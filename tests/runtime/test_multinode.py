"""Several nodes, proven on one machine: a Ray head and two worker nodes started with `ray start` as separate node
processes with their own resources (the way a user starts a cluster), joined by address. The rollout replica is
placed on one node and the FSDP2 ranks across the other two through Ray custom resources, weights cross nodes
through the collective path (`torch_distributed`), the placement is read back from Ray, and losing the rollout
node ends the run with an error naming it; `--resume` on a replacement node then trains every prompt once."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# Over 60 s by nature: three `ray start` nodes, then three training runs, each starting two FSDP2 rank actors and a
# replica on its own node (~3-5 min on 2 cores; past pytest's 300 s default on a loaded machine).
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.ray, pytest.mark.timeout(600)]
ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
EXAMPLE = str(ROOT / "examples" / "arithmetic_grpo.yaml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """`ray start` node processes (each `--block`, in a process group of its own so it can be killed whole)."""

    def __init__(self, tmp: Path):
        # RAY_AUTH_MODE: a cluster of this test only (a user's cluster passes its token: docs/cluster.md)
        self.env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RAY_worker_niceness": "0",
                    "RAY_AUTH_MODE": "disabled"}
        self.env.pop("RAY_ADDRESS", None)
        self.nodes: dict[str, subprocess.Popen] = {}
        self.tmp = tmp
        self._new_head()

    def _new_head(self) -> None:
        """A free port for the head and a temp dir of its own (short: Ray's socket paths live under it)."""
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp_dir = tempfile.mkdtemp(prefix="af-ray-")

    def start(self, name: str, resources: dict[str, float], head: bool = False) -> None:
        where = [f"--address={self.address}"]
        if head:  # its own temp dir: `ray.init()` elsewhere on this machine must not find this cluster
            where = ["--head", f"--port={self.port}", "--include-dashboard=false", f"--temp-dir={self.temp_dir}"]
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        self.nodes[name] = subprocess.Popen(
            [RAY, "start", *where, "--num-cpus=1", f"--resources={json.dumps(resources)}", "--disable-usage-stats",
             "--block"], env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        running = sum(process.poll() is None for process in self.nodes.values())
        self.wait_for(lambda nodes: sum(n["Alive"] for n in nodes) == running, f"node {name}", self.nodes[name])

    def start_three_nodes(self, tries: int = 3) -> None:
        """A head and a trainer node (`trainer_node`: one FSDP2 rank each) and a rollout node (`rollout_node`). On a
        loaded machine a node can miss Ray's own 30 s start limit, or the head lose its port (free when picked) to
        another process before it binds it: the whole cluster is then started again, on a new port."""
        for attempt in range(1, tries + 1):
            try:
                self.start("head", {"trainer_node": 1}, head=True)
                self.start("rollout", {"rollout_node": 1})
                self.start("trainer", {"trainer_node": 1})
                return
            except (AssertionError, subprocess.TimeoutExpired):  # a node that did not join; a head that did not start
                self.stop()
                if attempt == tries:
                    raise
                self._new_head()

    def live_nodes(self) -> list[dict]:
        """The cluster's nodes as `ray.nodes()` lists them (`NodeID`, `Alive`, `Resources`), read from its GCS by
        the client Ray's own node table uses: milliseconds, where a driver process per poll (`ray.init` to call
        `ray.nodes()`) took 1.5 s; it joins no cluster."""
        from ray._raylet import GcsClient
        from ray.core.generated.gcs_pb2 import GcsNodeInfo

        try:  # a client waits up to 40 s for a head that is not listening yet
            socket.create_connection(("127.0.0.1", self.port), timeout=5).close()
        except OSError as err:
            raise AssertionError(f"the head's port {self.port} takes no connection yet: {err}") from None
        nodes = GcsClient(address=self.address).get_all_node_info(timeout=30).values()
        return [{"NodeID": node.node_id.hex(), "Alive": node.state == GcsNodeInfo.ALIVE,
                 "Resources": dict(node.resources_total)} for node in nodes]

    def wait_for(self, ok, what: str, process: subprocess.Popen | None = None, timeout_s: float = 120) -> None:
        """Until `ok(live nodes)`; fails at once if `process` (the node being started) has exited."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise AssertionError(f"{what} exited with {process.returncode} before it joined the cluster")
            try:
                if ok(self.live_nodes()):
                    return
            except AssertionError:
                pass  # the head is still starting
            time.sleep(1)
        raise AssertionError(f"{what} did not join the cluster within {timeout_s} s")

    def kill(self, name: str) -> None:
        os.killpg(self.nodes[name].pid, signal.SIGKILL)
        self.nodes[name].wait(timeout=30)

    def stop(self) -> None:
        """Kill each node's process group (never `ray stop`: it would stop every Ray cluster on the machine)."""
        for process in self.nodes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        self.nodes.clear()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture
def cluster(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        cluster.start_three_nodes()
        yield cluster
    finally:
        cluster.stop()


def command(cluster: Cluster, run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "asyncflow.cli", "train", EXAMPLE, "sft.before_rl=false", "train.steps=4",
        "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=4", "train.micro_batch_size=4",
        "data.test_size=0", "checkpoint.every=1", "run.progress=false", "workflow.mode=async", "runtime.kind=ray",
        f"runtime.address={cluster.address}", "runtime.call_timeout_s=40", "runtime.start_timeout_s=40",
        "runtime.rollout_resources={rollout_node: 1}", "train.engine=fsdp2", "train.world_size=2",
        "runtime.trainer_resources={trainer_node: 1}",
        "runtime.weight_sync=torch_distributed", *extra, "--output", str(run_dir), "--threads", "1",
    ]


def train(cluster: Cluster, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(cluster, run_dir, *extra), env=cluster.env, capture_output=True, text=True,
                          timeout=500)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def last_step(run_dir: Path) -> int:
    """The newest logged step (-1 before the first)."""
    logged = rows(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    return logged[-1]["step"] if logged else -1


def placed(log: str) -> dict[str, str]:
    """worker -> the (shortened) node id its log line names (`... runs on node IP ID`)."""
    return dict(re.findall(r"(rollout replica \w+|training rank \d) runs on node \S+ (\w+)", log))


def node_ids(cluster: Cluster) -> dict[str, str]:
    """`head`, `rollout`, `trainer` -> Ray's node id, told apart by the resources each node was started with."""
    ids = {}
    for node in cluster.live_nodes():
        if node["Alive"]:
            name = "head" if "node:__internal_head__" in node["Resources"] else (
                "rollout" if "rollout_node" in node["Resources"] else "trainer")
            ids[name] = node["NodeID"][:12]
    return ids


def test_replicas_and_ranks_on_their_nodes_weights_across_and_a_lost_node_named(cluster, tmp_path):
    nodes = node_ids(cluster)
    refused = train(cluster, tmp_path / "shm", "runtime.weight_sync=shared_memory")
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert re.search(rf"rollout replica rollout_0 is on node \S+ {nodes['rollout']}", refused.stderr), refused.stderr

    # weights through Ray's object store first: a restarted replica can take them (gloo's group cannot)
    run_dir = tmp_path / "run"
    process = subprocess.Popen(command(cluster, run_dir, "train.steps=400", "runtime.weight_sync=ray"),
                               env=cluster.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while last_step(run_dir) < 3 and time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()[1][-3000:]
            time.sleep(0.5)
        cluster.kill("rollout")
        _, err = process.communicate(timeout=300)
    finally:
        process.kill()
    where = placed(err)
    assert where["rollout replica rollout_0"] == nodes["rollout"], (where, nodes)
    assert {where["training rank 0"], where["training rank 1"]} == {nodes["head"], nodes["trainer"]}, (where, nodes)
    assert process.returncode == 1, err[-3000:]
    error = [line for line in err.splitlines() if line.startswith("asyncflow")]
    lost = rf"rollout replica 'rollout_0' \(on node \S+ {nodes['rollout']}, lost\) did not come back"
    assert len(error) == 1 and re.search(lost, error[0]), err[-3000:]

    # resumed on a replacement node, weights by the collective path (gloo across nodes, then into the engine)
    cluster.start("rollout2", {"rollout_node": 1})
    stopped_at = last_step(run_dir)
    resumed = train(cluster, run_dir, f"train.steps={stopped_at + 3}", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert placed(resumed.stderr)["rollout replica rollout_0"] == node_ids(cluster)["rollout"]
    # the last step trains on version stopped_at + 2 with staleness <= 1: its rows were sampled with a version made
    # after the resume, which reached the replica's node only by gloo broadcast from the driver's node
    assert rows(run_dir)[-1]["staleness/max"] <= 1
    trained = [r for r in rows(run_dir) if r["step"] > 0]
    assert [r["step"] for r in trained] == list(range(1, stopped_at + 4)), "each step logged once"
    groups = [(r["data/group_id_min"], r["data/group_id_max"]) for r in trained]
    assert all(b[0] == a[1] + 1 for a, b in zip(groups, groups[1:])), f"prompts trained twice or skipped: {groups}"
