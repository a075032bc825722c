"""The NATS-cluster drill (issue 54, item 1): kill -9 one node of a three-node NATS cluster under load.

The stack of the fault drills (:class:`tests.faults.harness.Stack`) runs with ``nats_nodes=3``:
three clustered nats-servers (``shared.nats_cluster``), every process given all three, the
transitions stream at three replicas. The drill kills the node that leads the transitions
stream — the worst one to lose: JetStream must elect a new leader from the other two before a
publish is acknowledged again — while conversations run, and checks, as every drill does, that
no answer differs from its cold reference and that only errors a NATS fault explains occur.
Besides:

* while the node is down, the stream has a new leader, workers keep being acknowledged (the
  commit watermarks advance) and both loaded workers serve with reuse again;
* no worker lost its epoch, and ``wr``'s cache is retained (≥ 99 %, as for a NATS restart);
* the node, restarted on its ports from its store, rejoins: its replica of the stream is
  current again and its ``/healthz`` is ok.

The test then checks the whole history (no acknowledged transition missing from the log) and
the audit, as ``test_drills.py`` does.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from shared.nats_cluster import NatsCluster, http_json
from tests.faults.drills import NATS_DOWN, Fault, Run, kept_cache
from tests.faults.harness import Stack

DRILL = "nats-node-kill"


async def stream_cluster(stack: Stack) -> Any:
    """The transitions stream's cluster information (leader, replicas), asked as the operator."""
    return (await stack.nc.jetstream(timeout=5).stream_info(stack.subjects.stream_name)).cluster


async def clients_on(cluster: NatsCluster, i: int) -> list[str]:
    """The users connected to node ``i`` now (its monitoring endpoint)."""
    _, body = await asyncio.to_thread(http_json, f"{cluster.monitor_url(i)}/connz?auth=true&limit=1024")
    return sorted(str(c.get("authorized_user", "?")) for c in (body or {}).get("connections", []))


def acknowledged(run: Run) -> int:
    """Transitions covered by the commit watermarks the observer has seen (all workers, all epochs)."""
    return sum(run.observer.seen.watermarks.values())


async def _until(what: str, check: Any, timeout_s: float) -> float:
    t0 = time.monotonic()
    while True:
        try:
            if await check():
                return time.monotonic() - t0
        except Exception:  # noqa: BLE001 - the stream may be electing a leader: ask again
            pass
        assert time.monotonic() - t0 < timeout_s, f"{what} not within {timeout_s:.0f}s"
        await asyncio.sleep(0.2)


async def nats_node_kill(run: Run, drill: str = DRILL) -> Fault:
    stack = run.stack
    cluster = stack.nats
    assert isinstance(cluster, NatsCluster), "the drill needs Run(..., nats_nodes=3)"
    info = await stream_cluster(stack)
    assert info.leader in cluster.names and len(info.replicas) == len(cluster.names) - 1, info
    warm = await run.warm_retained(drill)
    load = await run.begin(drill)
    before = await run.epochs()
    victim = cluster.names.index(info.leader)
    on_victim = await clients_on(cluster, victim)
    acked0 = acknowledged(run)
    drops0 = stack.link_drops
    f = Fault(drill, f"NATS node {info.leader} (the stream's leader) kill -9 under load, restarted once the "
                     "fleet served with reuse again", run.history.now())
    t0 = time.monotonic()
    await stack.kill_nats_node(victim)
    probe = run.probe(drill, t0, "wa", "wb")
    leaders: list[str] = []

    async def new_leader() -> bool:
        c = await stream_cluster(stack)
        leaders.append(c.leader or "")
        return bool(c.leader) and c.leader != info.leader

    elected_s = await _until("a new stream leader", new_leader, 60)
    # the fleet serves with reuse on the two nodes left: leases, transitions and watermarks go on
    f.recovery_s = max(await probe)
    acked_down = acknowledged(run) - acked0
    t1 = time.monotonic()
    await stack.start_nats_node(victim)

    async def caught_up() -> bool:
        c = await stream_cluster(stack)
        peers = {p.name: p for p in c.replicas or []}
        back = c.leader == info.leader or (info.leader in peers and peers[info.leader].current
                                          and not peers[info.leader].offline)
        return back and all(p.current and not p.offline for p in peers.values())

    f.ready_s = await _until(f"{info.leader} rejoined and current", caught_up, 90)
    await asyncio.to_thread(cluster.wait_healthy, victim, 30)   # its /healthz: JetStream current there
    await load.wait_done(run.settings.after)
    await load.stop()
    f.retained_pct = await run.retained_pct(drill, warm)
    f.evidence.update({
        "killed": info.leader, "stream_leader": f"{info.leader}→{leaders[-1]}", "new_leader_s": round(elected_s, 1),
        "clients_on_killed_node": on_victim, "operator_link_drops": stack.link_drops - drops0,
        "acknowledged_while_down": acked_down,
        "rejoined_current_s": round(f.ready_s, 1), "down_s": round(t1 - t0, 1)})
    assert acked_down > 0, f"{drill}: no transition was acknowledged while {info.leader} was down"
    kept_cache(f, before, await run.epochs())
    return run.close(f, NATS_DOWN, load)
