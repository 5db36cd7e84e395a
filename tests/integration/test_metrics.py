"""Each agent's Prometheus metrics (resilient/agent/metrics.py): the translation of a
node's events into metrics, the HTTP endpoint and its knob, and a real Prometheus server
scraping a running 2-node job."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import urllib.parse
import urllib.request
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from launchutil import REPO, Agent, events, tiny_overrides, wait_for
from resilient.errors import ConfigError
from resilient.events import EventLog
from resilient.agent.metrics import AgentMetrics, MetricsPortInUse, QuarantineCount
from resilient.runconfig import LaunchConfig, load_runtime_config

DEMO = REPO / "configs" / "demo.toml"


def write(path: Path, **event) -> None:
    """One line as EventLog writes it, with the time given (recovery times are differences of it)."""
    with open(path, "a") as f:
        f.write(json.dumps({"rank": -1, **event}) + "\n")


def value(m: AgentMetrics, name: str, **labels) -> float | None:
    m.catch_up()
    return m.registry.get_sample_value(name, labels)


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read().decode()


# -- events -> metrics ---------------------------------------------------------------------

def test_a_nodes_events_become_its_metrics(tmp_path):
    log = tmp_path / "events.jsonl"
    write(log, time=1.0, event="step", node="a", rank=0, step=99)  # before the agent: not counted
    m = AgentMetrics(log, "a", "run7", quarantined=lambda: 2)
    for rank in (0, 1):
        write(log, time=10.0, event="step", node="a", rank=rank, step=3, loss=2.5, tokens_per_s=1200.0, seconds=0.1)
        write(log, time=10.1, event="snapshot", node="a", rank=rank, step=3, bytes=3 << 20, blocked_s=0.004)
        write(log, time=10.2, event="restore", node="a", rank=rank, tier="peer", step=2, seconds=1.5)
    write(log, time=10.3, event="commit", node="a", tier="local", step=3)
    write(log, time=10.4, event="commit", node="a", tier="durable", step=0)
    write(log, time=10.5, event="rendezvous", node="a", round=2, nodes=["a", "b"], world=4, seconds=0.8)
    write(log, time=10.6, event="sdc_suspect", node="a", rank=0, kind="replica_mismatch", step=3)
    write(log, time=10.7, event="sdc_verdict", node="a", rank=0, verdict="transient", step=3)
    write(log, time=10.8, event="rollback", node="a", rank=0, to_step=2)
    write(log, time=10.9, event="straggler", node="a", rank=0, cause="device", slow_node="b", factor=1.8)
    write(log, time=11.0, event="straggler", node="a", rank=0, cause="link", slow_node=None, factor=1.2)
    write(log, time=11.0, event="commit", node="b", tier="local", step=50)  # another node's: not ours
    write(log, time=11.1, event="step", node="a", rank=0, step=4, tokens_per_s="nan")  # NaN keeps the last rate

    assert value(m, "resilient_agent_info", node="a", run_id="run7") == 1
    assert value(m, "resilient_training_step") == 4
    assert value(m, "resilient_training_tokens_per_second") == 1200
    assert value(m, "resilient_committed_step", tier="local") == 3
    assert value(m, "resilient_committed_step", tier="durable") == 0
    assert value(m, "resilient_snapshot_blocked_seconds_count") == 2
    assert value(m, "resilient_snapshot_blocked_seconds_bucket", le="0.005") == 2
    assert value(m, "resilient_snapshot_size_bytes_sum") == 2 * (3 << 20)
    assert value(m, "resilient_restore_duration_seconds_sum", tier="peer") == 3.0
    assert value(m, "resilient_rendezvous_rounds_total") == 1
    assert value(m, "resilient_rendezvous_round") == 2
    assert value(m, "resilient_rendezvous_members") == 2
    assert value(m, "resilient_world_size") == 4
    assert value(m, "resilient_sdc_suspicions_total", kind="replica_mismatch") == 1
    assert value(m, "resilient_sdc_verdicts_total", verdict="transient") == 1
    assert value(m, "resilient_sdc_rollbacks_total") == 1
    assert value(m, "resilient_stragglers_total", cause="device") == 1
    assert value(m, "resilient_straggler_factor", slow_node="b") == 1.8
    assert value(m, "resilient_straggler_factor", slow_node="unlocated") == 1.2
    assert value(m, "resilient_quarantined_nodes") == 2
    assert value(m, "resilient_events_total", event="step") == 3


def test_a_recovery_is_timed_from_the_failure_to_the_first_step_after_the_restart(tmp_path):
    log = tmp_path / "events.jsonl"
    m = AgentMetrics(log, "a")
    write(log, time=100.0, event="failure", node="a", kind="exit", local_rank=1, exitcode=-9)
    write(log, time=100.2, event="failure", node="a", kind="exit", local_rank=0, exitcode=1)
    write(log, time=100.5, event="step", node="a", rank=0, step=7)  # a straggling old worker: not yet
    write(log, time=101.0, event="workers_started", node="a", round=2)
    write(log, time=103.5, event="step", node="a", rank=0, step=7)
    write(log, time=104.0, event="step", node="a", rank=0, step=8)
    assert value(m, "resilient_failures_total", kind="exit") == 2
    assert value(m, "resilient_recoveries_total", kind="exit") == 1
    assert value(m, "resilient_recovery_duration_seconds_sum", kind="exit") == pytest.approx(3.5)
    # A lost node, then a lost round while re-forming: one recovery, of the first kind, timed from it.
    write(log, time=200.0, event="failure", node="a", kind="node_lost", nodes=["b"])
    write(log, time=200.5, event="workers_started", node="a", round=3)
    write(log, time=201.0, event="failure", node="a", kind="round_lost", attempt=1)
    write(log, time=202.0, event="workers_started", node="a", round=4)
    write(log, time=204.0, event="step", node="a", rank=0, step=8)
    assert value(m, "resilient_recoveries_total", kind="node_lost") == 1
    assert value(m, "resilient_recovery_duration_seconds_sum", kind="node_lost") == pytest.approx(4.0)
    assert value(m, "resilient_recoveries_total", kind="round_lost") is None
    assert value(m, "resilient_failures_total", kind="round_lost") == 1


@pytest.mark.parametrize("chunk", [4 << 20, 7], ids=["whole", "7-byte-chunks"])
def test_the_log_is_followed_across_torn_lines_and_a_replaced_file(tmp_path, monkeypatch, chunk):
    import resilient.agent.metrics as metrics

    monkeypatch.setattr(metrics, "_CHUNK", chunk)
    log = tmp_path / "events.jsonl"
    m = AgentMetrics(log, "a")  # the log does not exist yet: read from its start
    assert value(m, "resilient_training_step") == 0
    with EventLog(log, node="a", rank=0) as ev:
        ev.emit("step", step=1, loss=1.0)
    line = json.dumps({"time": 1.0, "event": "step", "node": "a", "rank": 0, "step": 2}) + "\n"
    with open(log, "a") as f:
        f.write(line[:20])  # a writer mid-write
    assert value(m, "resilient_training_step") == 1
    with open(log, "a") as f:
        f.write(line[20:])
    assert value(m, "resilient_training_step") == 2
    assert value(m, "resilient_events_total", event="step") == 2
    os.replace(log, tmp_path / "old.jsonl")  # rotated: the new file is read from its start
    write(log, time=2.0, event="step", node="a", rank=0, step=3)
    assert value(m, "resilient_training_step") == 3


def test_two_agents_in_one_process_serve_their_own_metrics(tmp_path):
    log = tmp_path / "events.jsonl"
    a, b = AgentMetrics(log, "a"), AgentMetrics(log, "b")
    try:
        write(log, time=1.0, event="step", node="a", rank=0, step=5)
        write(log, time=1.0, event="step", node="b", rank=1, step=9)
        addr_a, addr_b = a.serve(0), b.serve(0)
        assert addr_a != addr_b
        assert "resilient_training_step 5.0" in scrape(addr_a)
        assert "resilient_training_step 9.0" in scrape(addr_b)
    finally:
        a.close()
        b.close()


def test_metrics_listen_on_loopback_unless_told_otherwise(tmp_path):
    """launch.metrics_host: the page is the operator's, not the network's, by default."""
    assert LaunchConfig().metrics_host == "127.0.0.1"
    for host, bound in ((None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")):
        m = AgentMetrics(tmp_path / "events.jsonl", "a")
        try:
            address = m.serve(0) if host is None else m.serve(0, host)
            assert m._server.server_address[0] == bound
            assert "resilient_training_step" in scrape(address)
        finally:
            m.close()


def test_a_taken_port_is_a_clear_error(tmp_path):
    m = AgentMetrics(tmp_path / "events.jsonl", "a")
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        with pytest.raises(MetricsPortInUse, match=r"launch.metrics_port.*0 for any free one.*-1 to turn"):
            m.serve(s.getsockname()[1])
    m.close()


def test_the_metrics_port_knob():
    from resilient.launch_args import parse_args

    assert LaunchConfig().metrics_port == 0  # on by default, on a free port
    assert load_runtime_config(None, ['launch.metrics_port="off"']).launch.metrics_port == -1
    assert load_runtime_config(None, ["launch.metrics_port=9400"]).launch.metrics_port == 9400
    for bad in ("launch.metrics_port=70000", 'launch.metrics_port="nine"', "launch.metrics_port=-2"):
        with pytest.raises(ConfigError, match="metrics_port.*-1"):
            load_runtime_config(None, [bad])
    # --metrics-port goes through the same check (resilient.launch.prepare_run replaces the knob).
    args = parse_args(["--metrics-port", "off", "train.py"])
    assert replace(LaunchConfig(), metrics_port=args.metrics_port).metrics_port == -1
    with pytest.raises(ConfigError):
        replace(LaunchConfig(), metrics_port=parse_args(["--metrics-port", "x", "train.py"]).metrics_port)


def test_etcd_latency_and_quarantine_come_from_a_real_etcd(tmp_path, etcd, job_secret):
    from resilient.agent.quarantine import Quarantine

    client = etcd.client()
    quarantined = QuarantineCount(etcd.client, "run7")
    m = AgentMetrics(tmp_path / "events.jsonl", "a", "run7", quarantined=quarantined,
                     quarantine_every=timedelta(0))
    try:
        m.watch_etcd([client, None])
        Quarantine(client, "run7").add("b", reason="test")
        client.put("/resilient/run7/x", "1")
        client.get("/resilient/run7/x")
        assert value(m, "resilient_etcd_request_duration_seconds_count", op="/kv/put") == 2
        # the add reads the record's generation first (resilient.ledger), then our get
        assert value(m, "resilient_etcd_request_duration_seconds_count", op="/kv/range") == 2
        assert value(m, "resilient_quarantined_nodes") == 1
        assert quarantined.client.retry_timeout == timedelta(seconds=1)  # a scrape must not hang on etcd
    finally:
        m.close()
        client.close()


# -- a real Prometheus scrapes a running job ---------------------------------------------------

def _prometheus_query(base: str, query: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


class Prometheus:
    """Debian's Prometheus server on a free port, scraping ``targets`` every second, its
    data in a temp dir; stopped and removed by :meth:`close`, also after a failed test."""

    def __init__(self, targets: list[str], where: Path):
        from resilient.etcd import free_port

        self.dir = Path(tempfile.mkdtemp(prefix="prometheus-", dir=where))
        config = self.dir / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{"job_name": "resilient", "static_configs": [{"targets": targets}]}],
        }))
        self.base = f"http://127.0.0.1:{free_port()}"
        self.log = open(self.dir / "prometheus.log", "w+")
        try:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'data'}",
                 f"--web.listen-address={self.base.removeprefix('http://')}", "--log.level=warn"],
                stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        except BaseException:
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            self.log.seek(0)
            raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self.log.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, q: str) -> list[dict]:
        return _prometheus_query(self.base, q)

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="no prometheus binary: install Debian's `prometheus` package (scripts/test does)")
def test_prometheus_scrapes_a_running_two_node_job(corpus, tmp_path, etcd):
    run = tmp_path / "run"
    run.mkdir()
    over = tiny_overrides(corpus, 2000, **{"snapshot.every": 1, "snapshot.durable_every": 5,
                                           "launch.spares": 0, "launch.heartbeat_timeout": 10.0})
    agents = [Agent(DEMO, run, over, node, nnodes="2", endpoint=etcd.endpoint, nproc=1) for node in ("a", "b")]
    prom = None
    try:
        found = wait_for(lambda: (lambda ev: ev if len(ev) == 2 else None)(
            {e["node"]: e["address"] for e in events(run, "metrics")}), 90, "both agents' metrics events")
        prom = Prometheus(sorted(found.values()), tmp_path)
        wait_for(prom.ready, 30, "prometheus to start")
        wait_for(lambda: len(prom.query('up{job="resilient"} == 1')) == 2, 60, "both agents scraped")

        def newest_committed() -> float | None:
            got = prom.query('max(resilient_committed_step{tier="local"})')
            return float(got[0]["value"][1]) if got else None

        first = wait_for(lambda: (v := newest_committed()) is not None and (v,), 90, "a committed step")[0]
        try:
            wait_for(lambda: (newest_committed() or -1) > first, 90, "the committed step to move")
        except AssertionError as e:   # say what the job did meanwhile (a stall, a re-form, no commits)
            seen = [(round(ev["time"] % 1000, 1), ev["node"], ev["event"], ev.get("step", ev.get("kind", "")))
                    for ev in events(run) if ev["event"] in ("commit", "failure", "rendezvous", "workers_started",
                                                             "heartbeat_timeout", "agent_stop")][-25:]
            raise AssertionError(f"{e}; Prometheus had {first}; the job's last events: {seen}; "
                                 f"agent b: {agents[1].output()[-1500:]}") from None

        members = {r["metric"]["instance"]: float(r["value"][1]) for r in prom.query("resilient_rendezvous_members")}
        assert members == {found["a"]: 2.0, found["b"]: 2.0}
        for series in ("resilient_training_step > 0", "resilient_training_tokens_per_second > 0",
                       "resilient_snapshot_blocked_seconds_count > 0", "resilient_snapshot_size_bytes_sum > 0",
                       "resilient_world_size == 2", "resilient_rendezvous_rounds_total >= 1",
                       # txn: every agent's rendezvous checks (the registry, read incrementally, asks by txn too)
                       'sum by (instance) (resilient_etcd_request_duration_seconds_count{op="/kv/txn"}) > 0'):
            # Waited for, not read once: a series appears at its event's step (the capture's
            # blocked time comes with the durable versions, every 5th step) plus a scrape.
            wait_for(lambda: len(prom.query(series)) == 2, 60, series)
        info = {r["metric"]["node"] for r in prom.query("resilient_agent_info")}
        assert info == {"a", "b"}
    finally:
        if prom is not None:
            prom.close()
        for agent in agents:
            agent.close()
