"""What a job is doing, for an operator, without reading JSON lines (the view of ``resilient
status``; the command itself is :mod:`resilient.commands.status`).

    resilient status RUN_DIR [--once] [--json] [--interval SECONDS]
    resilient status --rdzv-endpoint HOST:PORT --run-id ID [--secret-file FILE] [RUN_DIR]

Two sources, either or both:

* a run dir: every ``events.jsonl`` in it (one per node or process; the
  chaos harness's too), read incrementally so a refresh costs only the lines
  appended since the last one. They give the rendezvous round, the nodes and
  their worker state, the newest commit per tier, failures, recoveries,
  quarantine and the goodput so far (:mod:`resilient.observe.goodput`);
* the job's etcd: the records the agents keep there, read through the
  runtime's own authenticated readers (node registry:
  :func:`resilient.agent.membership.read_registry`; commits:
  :func:`resilient.snapshot.commits.read_commits`; quarantine:
  :class:`resilient.agent.quarantine.Quarantine`) with the job secret, reached
  as ``resilient quarantine`` reaches it (TLS/auth keys, the embedded etcd's
  login). A record that fails authentication is left out, never shown. A run
  dir whose job is running with its embedded etcd (``RUN_DIR/control/etcd.json``)
  is read from etcd too, with no option.

The view refreshes like ``top`` until Ctrl-C; ``--once`` prints it once (for
scripts), ``--json`` prints the same facts as JSON (one object per refresh).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from resilient.events import EventTail
from resilient.observe.goodput import goodput

RECENT = 5  # failures and recoveries shown
QUIET_S = 120.0  # a live job writes a step event every step: this long without any event is worth saying


class RunLog:
    """Every event of a run dir's logs so far, read incrementally (:class:`EventTail`)."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.tail = EventTail(run_dir)
        self.run_dir = self.tail.run_dir
        self.events: list[dict] = []

    def paths(self) -> list[Path]:
        return self.tail.paths()

    def poll(self) -> list[dict]:
        new = self.tail.poll()
        if new:
            self.events.extend(new)
            self.events.sort(key=lambda e: e["time"])  # nearly sorted: cheap
        return self.events


# ---------------------------------------------------------------- facts from the events
def _node_states(events: list[dict]) -> dict[str, dict]:
    """node → what its agent and workers last did."""
    nodes: dict[str, dict] = {}
    for e in events:
        kind, node = e.get("event"), e.get("node")
        if node is None or node == "chaos":
            continue
        n = nodes.setdefault(str(node), {"node": str(node), "state": "starting"})
        if kind == "agent_start":
            n.update(state="waiting", since=e["time"], round=None, ranks=[], pids=[], stopped=None,
                     **({"domain": e["domain"]} if e.get("domain") else {}))
        elif kind == "agent_stop":
            n.update(state="stopped", stopped=e.get("reason"), since=e["time"])
        elif kind == "metrics":
            n["metrics"] = e.get("address")
        elif kind == "rendezvous":
            n.update(round=e.get("round"), world=e.get("world"))
        elif kind == "workers_started":
            n.update(state="training", since=e["time"], ranks=e.get("local_ranks", []), pids=e.get("pids", []))
        elif kind in ("failure", "heartbeat_timeout") and n["state"] != "stopped":
            n.update(state="restarting", since=e["time"])
        elif kind == "preemption":
            n.update(state="preempted", since=e["time"])
        elif kind == "quarantine" and e.get("rank", -1) == -1:
            n.update(state="quarantined", since=e["time"])
        elif kind == "step" and isinstance(e.get("step"), int):
            n.update(step=e["step"], step_time=e["time"])
            if n["state"] == "restarting":
                n["state"] = "training"
    return nodes


def _committed(events: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in events:
        if e.get("event") == "commit" and isinstance(e.get("step"), int):
            tier = str(e.get("tier") or ("durable" if "url" in e else "unknown"))
            out[tier] = max(out.get(tier, -1), e["step"])
    return out


def _failures(events: list[dict]) -> list[dict]:
    keep = ("kind", "local_rank", "exitcode", "nodes", "pid", "reason")
    out = [{"time": e["time"], "node": e.get("node"), **{k: e[k] for k in keep if k in e}}
           for e in events if e.get("event") == "failure"]
    return out[-RECENT:]


def from_events(events: list[dict], now: float) -> dict:
    """The status facts a run dir's events give."""
    nodes = _node_states(events)
    starts = [e for e in events if e.get("event") == "agent_start"]
    rdzv = [e for e in events if e.get("event") == "rendezvous"]
    live = [n for n in nodes.values() if n["state"] != "stopped"]
    newest = rdzv[-1] if rdzv else None
    last = events[-1]["time"] if events else None
    # An agent killed with -9 writes no stop: a "live" job whose log went quiet may be gone.
    quiet = bool(live) and last is not None and now - last > QUIET_S
    g = goodput(events, end=now if live and not quiet else None)
    restores = [e for e in events if e.get("event") == "restore"]
    recoveries = []
    for inc in g.incidents[-RECENT:]:
        tiers = sorted({str(r.get("tier")) for r in restores if inc.start <= r["time"] <= inc.end})
        recoveries.append({"cause": inc.cause, "start": inc.start, "detected_at": inc.detected_at, "end": inc.end,
                           "finished": inc.finished, "seconds": round(inc.end - inc.start, 3),
                           "redone_steps": inc.redone_steps, "tiers": tiers})
    quarantine = {str(e.get("node")): {k: e.get(k) for k in ("time", "device", "reason", "local_ranks")}
                  for e in events if e.get("event") == "quarantine" and e.get("rank", -1) == -1}
    steps = [e["step"] for e in events if e.get("event") == "step" and isinstance(e.get("step"), int)]
    return {
        "run_id": starts[-1].get("run_id") if starts else None,
        "endpoint": starts[-1].get("endpoint") if starts else None,
        "state": (f"quiet (no event for {now - last:.0f} s: ended without a stop, or hung)" if quiet
                  else "running" if live else "finished" if all(n.get("stopped") == "finished" for n in nodes.values())
                  else "stopped") if nodes else "not started",
        "last_event": last,
        # Each agent numbers the rounds it took part in: a node that joined late counts from 1.
        "round": None if newest is None else {"round": max((n.get("round") or 0) for n in nodes.values()),
                                             "nodes": newest.get("nodes"), "world": newest.get("world"),
                                             "time": newest["time"]},
        "step": max(steps, default=None),
        "nodes": nodes,
        "committed": _committed(events),
        "failures": _failures(events),
        "recoveries": recoveries,
        "quarantine": quarantine,
        "goodput": {k: v for k, v in g.to_dict().items() if k != "incidents"},
    }


# ---------------------------------------------------------------- facts from etcd
def from_etcd(endpoint: str, run_id: str, rdzv_conf: str = "", secret_file: str | None = None,
              run_dir: str | None = None, embedded: bool = False) -> dict:
    """The node registry, the newest commit per memory tier and the quarantine, from the job's
    etcd, every record authenticated with the job secret. Errors (etcd gone: the job ended)
    come back as ``{"error": ...}``: a status view must not die with the job it watches."""
    from resilient.agent.membership import read_registry
    from resilient.agent.quarantine import Quarantine
    from resilient.control.reach import cli_client, cli_secret
    from resilient.snapshot.commits import read_commits

    args = argparse.Namespace(rdzv_endpoint=endpoint, run_id=run_id, secret_file=secret_file, run_dir=run_dir,
                              rdzv_conf=rdzv_conf or "retry_timeout=2", embedded=embedded)
    try:
        secret = cli_secret(args)
        with cli_client(args, secret) as client:
            registry = read_registry(client, run_id, secret)
            commits = read_commits(client, run_id, secret)
            quarantine = Quarantine(client, run_id, secret).all()
    except Exception as e:  # noqa: BLE001  (shown, not raised: see the docstring)
        return {"endpoint": endpoint, "error": f"{type(e).__name__}: {e}"}
    committed: dict[str, int] = {}
    for rec in commits:
        committed[rec.tier] = max(committed.get(rec.tier, -1), rec.step)
    return {"endpoint": endpoint, "registry": registry, "committed": committed, "quarantine": quarantine}


# ---------------------------------------------------------------- the view
def collect(tail: RunLog | None, now: float | None = None) -> dict:
    """The status document from the run dir's events (or an empty one without a run dir)."""
    now = time.time() if now is None else now
    st = from_events(tail.poll(), now) if tail is not None else {
        "run_id": None, "state": "unknown", "nodes": {}, "committed": {}, "failures": [], "recoveries": [],
        "quarantine": {}, "goodput": None, "round": None, "step": None}
    st.update(time=now, run_dir=str(tail.run_dir) if tail is not None else None)
    return st


def merge_etcd(st: dict, etcd: dict | None) -> dict:
    """Add etcd's live records to a status document (both sources speak of commits and
    quarantine: the newest of the two wins), and make ``nodes`` a list sorted by node id."""
    if etcd is not None:
        st["etcd"] = {k: v for k, v in etcd.items() if k in ("endpoint", "error")}
        if st["state"] == "unknown":  # etcd alone: a registry entry lives exactly as long as its agent
            st["state"] = "running" if etcd.get("registry") else "no live node" if "error" not in etcd else "unknown"
        for node, desc in (etcd.get("registry") or {}).items():
            n = st["nodes"].setdefault(node, {"node": node, "state": "registered"})
            n.update(domain=desc.get("domain"), host=desc.get("host"), registered=True,
                     **({"metrics": desc["metrics"]} if desc.get("metrics") else {}))
        for tier, step in (etcd.get("committed") or {}).items():
            st["committed"][tier] = max(st["committed"].get(tier, -1), step)
        for node, rec in (etcd.get("quarantine") or {}).items():
            st["quarantine"][node] = {k: rec.get(k) for k in ("time", "device", "reason", "local_ranks")}
    for node in st["quarantine"]:
        if node in st["nodes"]:
            st["nodes"][node]["quarantined"] = True
    st["nodes"] = [st["nodes"][k] for k in sorted(st["nodes"])]
    return st


def _ago(t: float | None, now: float) -> str:
    return "—" if t is None else f"{max(0.0, now - t):.0f} s ago" if now - t < 3600 else time.strftime("%H:%M:%S", time.localtime(t))


def render(st: dict) -> str:
    """The terminal view (plain text: no curses, so it works in any pipe or log)."""
    now = st["time"]
    head = f"resilient status — {st.get('run_id') or '?'}"
    if st.get("run_dir"):
        head += f" ({st['run_dir']})"
    lines = [head, f"state: {st['state']}   step: {st.get('step') if st.get('step') is not None else '—'}   "
             f"at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}"]
    rd = st.get("round")
    if rd:
        lines.append(f"round {rd['round']}: {len(rd.get('nodes') or [])} nodes {', '.join(rd.get('nodes') or [])}, "
                     f"world {rd.get('world')} (formed {_ago(rd['time'], now)})")
    tiers = st.get("committed") or {}
    lines.append("committed: " + ("   ".join(f"{t} {tiers[t]}" for t in ("local", "peer", "durable") if t in tiers)
                                  or "nothing yet"))
    g = st.get("goodput")
    if g and g.get("wall_s"):
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in g["parts_s"].items() if v > 0)
        lines.append(f"goodput: {100 * (g['ratio'] or 0):.1f}% of {g['wall_s']:.0f} s ({parts})")
    if st.get("etcd"):
        e = st["etcd"]
        lines.append(f"etcd {e['endpoint']}: " + (f"unreachable ({e['error']})" if e.get("error") else "read"))
    lines += ["", f"{'NODE':<12} {'DOMAIN':<10} {'STATE':<28} {'ROUND':>5} {'RANKS':<8} {'STEP':>7}  LAST STEP"]
    for n in st["nodes"]:
        why = str(n.get("stopped") or "").split(":")[0]  # "rendezvous_failed: <the error>": the kind is enough here
        state = n["state"] + (f" ({why})" if why and n["state"] == "stopped" else "")
        if n.get("quarantined"):
            state = "quarantined"
        ranks = ",".join(str(r) for r in n.get("ranks") or []) or "—"
        lines.append(f"{n['node']:<12} {str(n.get('domain') or '—'):<10} {state[:28]:<28} {str(n.get('round') or '—'):>5} "
                     f"{ranks:<8} {str(n.get('step', '—')):>7}  {_ago(n.get('step_time'), now)}")
    lines += ["", "recent failures:"]
    for f in st["failures"] or []:
        what = ", ".join(f"{k} {f[k]}" for k in ("local_rank", "exitcode", "nodes", "reason") if k in f)
        lines.append(f"  {_ago(f['time'], now):>10}  {f.get('node')}: {f.get('kind')}" + (f" ({what})" if what else ""))
    if not st["failures"]:
        lines.append("  none")
    lines.append("recent recoveries:")
    for r in st["recoveries"] or []:
        how = f"training again after {r['seconds']:.1f} s" if r["finished"] else f"not training yet ({r['seconds']:.1f} s)"
        tiers = f", restored from {'/'.join(r['tiers'])}" if r["tiers"] else ""
        lines.append(f"  {_ago(r['start'], now):>10}  {r['cause']}: {how}{tiers}, {r['redone_steps']} steps redone")
    if not st["recoveries"]:
        lines.append("  none")
    q = st.get("quarantine") or {}
    lines.append("quarantined: " + (", ".join(f"{k} ({v.get('reason') or '?'}, device {v.get('device') or '?'})"
                                              for k, v in sorted(q.items())) or "none"))
    return "\n".join(lines)
