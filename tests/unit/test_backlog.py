"""worker.backlog: the prompt tokens a queued request will compute, as the admission counts them."""

from __future__ import annotations

from shared.hashing import chain_hashes
from worker.backlog import PromptWork, leading_known

BS = 16


class _Worker:
    """The engine's ports the estimate reads: the blocks held are a set here (a pure core's unit test)."""

    cache_enabled = True
    block_size = BS
    namespace = "ab" * 8

    def __init__(self) -> None:
        self.held: set[str] = set()

    def salt(self, tenant: str) -> bytes:
        return tenant.encode()

    def holds_block(self, block_hash: str) -> bool:
        return block_hash in self.held


def test_only_a_leading_run_counts() -> None:
    assert leading_known(["a", "b", "c"], {"a", "c"}.__contains__) == 1
    assert leading_known([], bool) == 0


def test_a_prompt_counts_what_is_not_held_claimed_or_computed_ahead_of_it() -> None:
    w, claims = _Worker(), set()
    work = PromptWork(w, claims.__contains__)
    system = list(range(512))
    turn = system + list(range(1000, 1192))                       # 704 tokens: 44 blocks
    hs = chain_hashes(turn, BS, "ab" * 8, b"t")
    assert work.estimate(1, turn, "t", reuse=True, has_images=False) == 704
    w.held.update(hs[:32])                                         # the system prompt is held here
    assert work.estimate(1, turn, "t", reuse=True, has_images=False) == 704 - 512
    assert work.estimate(2, turn, "other", reuse=True, has_images=False) == 704   # another tenant's salt
    assert work.estimate(3, turn, "t", reuse=False, has_images=False) == 704
    assert work.estimate(4, turn, "t", reuse=True, has_images=True) == 704
    claims.update(hs[32:40])                                       # another request computes 8 more
    assert work.estimate(1, turn, "t", reuse=True, has_images=False) == 704 - 640
    assert work.estimate(1, turn, "t", reuse=True, has_images=False, claims=False) == 704 - 512
    # two queued requests with the same new prompt: the second reads what the first computes
    w.held.clear()
    claims.clear()
    ahead: set[str] = set()
    assert work.estimate(5, turn, "t", reuse=True, has_images=False, ahead=ahead) == 704
    assert work.estimate(6, turn + [7] * 20, "t", reuse=True, has_images=False, ahead=ahead) == 724 - 704
    work.forget(5)
    assert work.estimate(5, [1] * 10, "t", reuse=True, has_images=False) == 10     # shorter than a block
