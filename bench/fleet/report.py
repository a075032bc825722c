"""The figures of ``bench.fleet`` from its rounds' counts, and the table printed beside the JSON (pure)."""

from __future__ import annotations

from typing import Any

#: Roles whose CPU is counted, in the table's order (``bench.proc_cpu.stack_cpu`` roles, the
#: coordinators and drivers summed over their processes).
ROLES = ("coordinators", "drivers", "postgres", "nats", "bench")
#: The ledger's own machines' share (what a deployment sizes): not the workers' (the drivers here).
LEDGER = ("coordinators", "postgres", "nats")


def round_keys(r: dict[str, Any]) -> dict[str, Any]:
    """The keys of one round (``r``: what :func:`bench.fleet.run.one_round` measured)."""
    n = r["shards"]
    leases = sum(r["leases_by_shard"])
    cpu = sum(r["cpu_s"].values())
    per_shard = r["leases_by_shard"]
    idle = sum(r["idle_cpu_s_per_s"].values())
    # what the leases cost beyond the idle fleet's steady cost over the same seconds
    marginal = cpu - idle * r["wall_s"]
    return {
        f"leases_per_s_shards{n}": round(leases / r["wall_s"], 1),
        f"cpu_us_per_lease_shards{n}": round(1e6 * cpu / leases, 1) if leases else None,
        f"leases_per_cpu_s_shards{n}": round(leases / cpu, 1) if cpu else None,
        **{f"cpu_us_per_lease_shards{n}_{role}": round(1e6 * r["cpu_s"].get(role, 0.0) / leases, 1) if leases else None
           for role in ROLES},
        f"cpu_us_per_lease_ledger_shards{n}": round(1e6 * sum(r["cpu_s"].get(k, 0.0) for k in LEDGER) / leases, 1)
        if leases else None,
        f"idle_cpu_ms_per_s_shards{n}": round(1000 * idle, 1),
        f"idle_cpu_ms_per_s_by_role_shards{n}": {k: round(1000 * v, 1) for k, v in r["idle_cpu_s_per_s"].items()},
        f"cpu_us_per_lease_beyond_idle_shards{n}": round(1e6 * marginal / leases, 1) if leases else None,
        # group commit: fewer leases per append as a shard's share of the load shrinks
        f"append_txs_per_lease_shards{n}": round(r["append_txs"] / leases, 3) if leases else None,
        f"append_events_per_tx_shards{n}": round(r["append_events"] / r["append_txs"], 1) if r["append_txs"] else None,
        f"leases_shards{n}": leases,
        f"leases_by_shard_shards{n}": per_shard,
        # the busiest shard against an even split (1.0 = even; the hot roots' cost, item 3)
        f"hottest_shard_share_shards{n}": round(max(per_shard) * n / leases, 3) if leases else None,
        f"reuse_share_shards{n}": round(r["blocks_read"] / max(1, r["blocks_read"] + r["blocks_written"]), 3),
        f"wrong_shard_shards{n}": r["wrong_shard"],
        f"errors_shards{n}": sum(r["errors"].values()),
        f"heartbeats_per_s_shards{n}": round(r["heartbeats"] / r["wall_s"], 1),
        f"wall_s_shards{n}": round(r["wall_s"], 2),
        f"workers_shards{n}": r["workers"],
    }


def fleet_keys(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Every round's keys, and ``scaling_efficiency_shards<N>``: leases per CPU-second at N shards
    over the same at one shard (needs a one-shard round; 1.0 for it); ``…_beyond_idle``: the same
    of the CPU beyond the idle fleet's (heartbeats and timers, paid per second, not per lease);
    ``…_ledger``: of the coordinators', PostgreSQL's and NATS's CPU only (not the workers')."""
    out: dict[str, Any] = {}
    for r in rounds:
        out.update(round_keys(r))
    base = out.get("leases_per_cpu_s_shards1")
    for r in rounds:
        n = r["shards"]
        mine = out.get(f"leases_per_cpu_s_shards{n}")
        if base and mine:
            out[f"scaling_efficiency_shards{n}"] = round(mine / base, 3)
        one, this = out.get("cpu_us_per_lease_beyond_idle_shards1"), out.get(f"cpu_us_per_lease_beyond_idle_shards{n}")
        if one and this and this > 0:
            out[f"scaling_efficiency_beyond_idle_shards{n}"] = round(one / this, 3)
        one, this = out.get("cpu_us_per_lease_ledger_shards1"), out.get(f"cpu_us_per_lease_ledger_shards{n}")
        if one and this:
            out[f"scaling_efficiency_ledger_shards{n}"] = round(one / this, 3)
    return out


#: Issue 54's goal for the efficiency at every shard count.
EFFICIENCY_GOAL = 0.9


def goals(keys: dict[str, Any], shards: list[int], run_wrong_shard: int, run_errors: int) -> dict[str, bool]:
    """``{"<figure> <op> <bound>": met}``: the efficiency goal per shard count above one, and the
    checks that every lease went to its owner (0 ``wrong_shard``) and nothing failed, over the whole run."""
    out = {f"scaling_efficiency_shards{n} >= {EFFICIENCY_GOAL}": keys.get(f"scaling_efficiency_shards{n}", 0) >= EFFICIENCY_GOAL
           for n in shards if n > 1}
    out["wrong_shard == 0"] = run_wrong_shard == 0 and all(keys.get(f"wrong_shard_shards{n}") == 0 for n in shards)
    out["errors == 0"] = run_errors == 0 and all(keys.get(f"errors_shards{n}") == 0 for n in shards)
    return out


def table(keys: dict[str, Any], shards: list[int]) -> str:
    """A readable table of the main keys, one row per shard count."""
    head = ["shards", "leases/s", "CPU us/lease", "leases/CPU-s", "efficiency", "coord", "drivers", "postgres",
            "nats", "idle CPU ms/s", "us/lease beyond idle", "efficiency beyond idle", "hottest", "wrong_shard",
            "errors"]
    rows: list[list[Any]] = [head]
    for n in shards:
        def k(name: str, n: int = n) -> Any:
            v = keys.get(f"{name}_shards{n}")
            return "-" if v is None else v
        rows.append([n, k("leases_per_s"), k("cpu_us_per_lease"), k("leases_per_cpu_s"), k("scaling_efficiency"),
                     *(keys.get(f"cpu_us_per_lease_shards{n}_{role}", "-") for role in ROLES[:4]),
                     k("idle_cpu_ms_per_s"), k("cpu_us_per_lease_beyond_idle"), k("scaling_efficiency_beyond_idle"),
                     k("hottest_shard_share"), k("wrong_shard"), k("errors")])
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


__all__ = ["EFFICIENCY_GOAL", "LEDGER", "ROLES", "fleet_keys", "goals", "round_keys", "table"]
