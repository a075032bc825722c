"""worker.inflight: claims on blocks a live request will commit, and waits on them."""

from __future__ import annotations

import asyncio

from worker.inflight import InFlightBlocks, wait_for


async def test_a_claim_is_seen_by_others_only_until_it_is_resolved() -> None:
    f, a, b = InFlightBlocks(), object(), object()
    assert f.claim(a, ["h1", "h2", "h3"]) == 3
    assert f.claim(b, ["h2", "h4"]) == 1                # h2 is a's: only h4 is b's
    assert f.others(["h1", "h2", "h4"], a) == [f.others(["h4"], a)[0]]
    theirs = f.others(["h1", "h2", "h9"], b)
    assert len(theirs) == 2 and not any(x.done() for x in theirs)
    f.committed(a, ["h1"])
    f.committed(b, ["h2"])                              # not b's claim: nothing happens
    assert theirs[0].result() is True and not theirs[1].done()
    assert len(f.others(["h1", "h2"], b)) == 1          # h1 left the table once committed
    f.drop(a)
    assert theirs[1].result() is False                  # a closed without committing h2
    assert f.others(["h1", "h2", "h3"], b) == [] and len(f) == 1    # b's h4 stays


async def test_keep_narrows_a_claim_to_what_the_grant_lets_it_write() -> None:
    f, a, b = InFlightBlocks(), object(), object()
    f.claim(a, ["h1", "h2", "h3"])
    waiting = f.others(["h1", "h2", "h3"], b)
    f.keep(a, ["h3"])                                   # h1, h2 were cached already: a reads them
    assert [x.done() for x in waiting] == [True, True, False]
    assert [x.result() for x in waiting[:2]] == [False, False]
    assert await wait_for(waiting[:2], 1.0) == "abandoned"


async def test_wait_for_reports_committed_abandoned_or_timeout() -> None:
    f, a, b = InFlightBlocks(), object(), object()
    assert await wait_for([], 0.01) == "committed"
    f.claim(a, ["h1", "h2"])
    futures = f.others(["h1", "h2"], b)
    assert await wait_for(futures, 0.02) == "timeout"
    assert not any(x.cancelled() for x in futures)      # shared with other waiters: never cancelled
    asyncio.get_running_loop().call_later(0.01, f.committed, a, ["h1", "h2"])
    assert await wait_for(futures, 5.0) == "committed"


async def test_a_wait_runs_out_only_after_its_bound_passes_with_the_worker_idle() -> None:
    f, a, b = InFlightBlocks(), object(), object()
    f.claim(a, ["h1"])
    [fut] = f.others(["h1"], b)
    busy = [True]

    async def worker_prefills_then_commits() -> None:
        await asyncio.sleep(0.75)           # prompts computed for 3 × the bound
        busy[0] = False
        await asyncio.sleep(0)              # then idle, far under the bound, until the commit
        f.committed(a, ["h1"])              # (a loaded CI machine stretched a 30 ms idle past 80 ms)

    task = asyncio.create_task(worker_prefills_then_commits())
    assert await wait_for([fut], 0.25, lambda: busy[0]) == "committed"
    await task
    # with nothing computed the same bound runs out
    f.claim(a, ["h2"])
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await wait_for(f.others(["h2"], b), 0.08, lambda: busy[0]) == "timeout"
    assert 0.08 <= loop.time() - t0 < 1.0
    assert await wait_for(f.others(["h2"], b), 0.05) == "timeout"     # no busy probe: the bound in all
