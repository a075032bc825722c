"""Resume from cached blocks: bit-identical logits to the uninterrupted block-aligned run.

The cold run prefills the 200-token prompt in one-block units and exports every block. A
resumed request restores the payloads of the first ``n`` blocks into a fresh state and
prefills the rest, then decodes; its logits must equal the cold run's bit for bit. ``n``
sweeps every block boundary of the prompt: 16 (first HCA window), 32 (the window), 48, …,
112/128/144 (around 128), 192.
"""

from __future__ import annotations

import pytest
import torch

from worker.model import RequestState
from worker.model.forms import COMPRESSED, INDEXER, SWA, TAIL

BLOCK = 16
DECODE = [17, 200, 3, 99, 42, 0, 255, 128]      # tokens decoded after the prompt
SWEEP = list(range(1, 13))                      # every boundary 16 .. 192 (incl. 16/32/128 and neighbours)


@pytest.fixture(scope="module")
def cold_with_decode(tiny, tokens):
    state = tiny.new_state(BLOCK)
    prefill = tiny.prefill(tokens, state)
    blocks = [state.export_block(i) for i in range(state.completed_blocks)]
    decode = torch.stack([tiny.decode_step(t, state) for t in DECODE])
    return prefill, blocks, decode


def resume(model, blocks, n, rest, block=BLOCK):
    state = RequestState.from_blocks(model.cfg, block, blocks, n)
    assert state.pos == n * block
    return state, model.prefill(rest, state)


def test_cold_run_is_deterministic(tiny, tokens, cold_with_decode) -> None:
    state = tiny.new_state(BLOCK)
    assert torch.equal(tiny.prefill(tokens, state), cold_with_decode[0])


@pytest.mark.parametrize("n", SWEEP)
def test_resume_sweep_bit_identical(tiny, tokens, cold_with_decode, n) -> None:
    cold, blocks, cold_decode = cold_with_decode
    state, warm = resume(tiny, blocks, n, tokens[n * BLOCK:])
    assert torch.equal(warm, cold[n * BLOCK:])
    decode = torch.stack([tiny.decode_step(t, state) for t in DECODE])
    assert torch.equal(decode, cold_decode)
    # The resumed state exports the same payloads for the blocks it computed.
    for i in range(n, len(blocks)):
        again = state.export_block(i)
        assert all(torch.equal(again[f], blocks[i][f]) for f in blocks[i])


def test_resume_needs_only_the_declared_pieces(tiny, tokens, cold_with_decode) -> None:
    """History forms for every block, swa for the window blocks, tail for the last block."""
    cold, blocks, _ = cold_with_decode
    n = 8
    window_first = (n * BLOCK - 31) // BLOCK
    sparse = []
    for i in range(n):
        keep = {COMPRESSED, INDEXER} | ({SWA} if i >= window_first else set()) | ({TAIL} if i == n - 1 else set())
        sparse.append(type(blocks[i])({f: blocks[i][f] for f in keep}, blocks[i].specs))
    _, warm = resume(tiny, sparse, n, tokens[n * BLOCK:])
    assert torch.equal(warm, cold[n * BLOCK:])
    missing_tail = sparse[:n - 1] + [type(blocks[n - 1])({f: blocks[n - 1][f] for f in (COMPRESSED, INDEXER, SWA)},
                                                         blocks[n - 1].specs)]
    with pytest.raises(ValueError, match="block 7 lacks form 'tail'"):
        tiny.new_state(BLOCK).restore(missing_tail, n)


def test_chained_resume_from_blocks_written_by_resumed_requests(tiny, tokens, cold_with_decode) -> None:
    """Blocks exported by a resumed request serve a later resume just as well."""
    cold, blocks, _ = cold_with_decode
    state, _ = resume(tiny, blocks, 2, tokens[32:144])           # computes blocks 2..8
    mixed = blocks[:2] + [state.export_block(i) for i in range(2, 9)]
    _, warm = resume(tiny, mixed, 9, tokens[144:])
    assert torch.equal(warm, cold[144:])


def test_resume_with_block_size_32(tiny, tokens) -> None:
    state = tiny.new_state(32)
    cold = tiny.prefill(tokens, state)
    blocks = [state.export_block(i) for i in range(state.completed_blocks)]
    for n in (1, 4):                                              # boundaries 32 and 128
        _, warm = resume(tiny, blocks, n, tokens[n * 32:], block=32)
        assert torch.equal(warm, cold[n * 32:])


def test_larger_units_are_exact_on_their_grid(tiny, tokens) -> None:
    """chunk_blocks=4 runs 64-token units; a resume at a multiple of 64 repeats them exactly."""
    state = tiny.new_state(BLOCK)
    cold = tiny.prefill(tokens, state, chunk_blocks=4)
    blocks = [state.export_block(i) for i in range(state.completed_blocks)]
    for n in (4, 8):
        st = tiny.new_state(BLOCK)
        st.restore(blocks, n)
        assert torch.equal(tiny.prefill(tokens[n * BLOCK:], st, chunk_blocks=4), cold[n * BLOCK:])


def test_decode_made_blocks_are_exported_and_equal_prefill_made_ones(tiny, tokens) -> None:
    """With batch-invariant ops a block completed by decode steps (or an unaligned chunk) holds
    exactly the bits a prefill computes, for every form, so it is exportable like any."""
    cold = tiny.new_state(BLOCK)
    tiny.prefill(tokens[:64], cold)
    state = tiny.new_state(BLOCK)
    tiny.prefill(tokens[:40], state)                              # blocks 0, 1 + partial [32, 40)
    with pytest.raises(ValueError, match="block 2 is not exportable"):
        state.export_block(2)
    for t in tokens[40:64]:
        tiny.decode_step(t, state)                                # completes blocks 2, 3 by decode
    for i in range(4):
        a, b = state.export_block(i), cold.export_block(i)
        assert a.keys() == b.keys()
        for form in a:
            assert torch.equal(a[form].view(torch.int32), b[form].view(torch.int32)), (i, form)
    with pytest.raises(ValueError, match="prefill must start on a block boundary"):
        tiny.prefill(tokens[48:50], _at(tiny, 3))


def test_without_invariant_ops_only_block_aligned_units_are_exported(tiny, tokens) -> None:
    tiny.batch_invariant = False
    try:
        state = tiny.new_state(BLOCK)
        tiny.prefill(tokens[:40], state)
        state.export_block(1)
        for t in tokens[40:48]:
            tiny.decode_step(t, state)
        with pytest.raises(ValueError, match="not computed by a block-aligned unit"):
            state.export_block(2)
        with pytest.raises(RuntimeError, match="not batch-invariant"):
            tiny.forward_batch([(tokens[:2], tiny.new_state(BLOCK)), (tokens[:3], tiny.new_state(BLOCK))])
    finally:
        tiny.batch_invariant = True


def _at(model, n_tokens):
    state = model.new_state(BLOCK)
    model.extend(torch.arange(n_tokens), state)
    return state


def test_a_state_written_in_inference_mode_stays_usable_outside_it(tiny, tokens, cold_with_decode) -> None:
    """The forward runs in inference mode; the state it writes is used after it, outside that
    mode, by a restore into it, a fork and an export, and another forward follows on it."""
    cold, blocks, cold_decode = cold_with_decode
    state = tiny.new_state(BLOCK)
    logits = tiny.forward_batch([(tokens[:4 * BLOCK], state)])[0]
    assert logits.is_inference() and not torch.is_inference_mode_enabled()
    assert not any(t.is_inference() for t in state.export_block(0).values())
    state.restore(blocks, 8)                      # in place, outside inference mode
    assert torch.equal(tiny.prefill(tokens[8 * BLOCK:], state), cold[8 * BLOCK:])
    twin = state.fork()
    assert torch.equal(tiny.decode_step(DECODE[0], twin), cold_decode[0])
    assert torch.equal(tiny.decode_step(DECODE[0], state), cold_decode[0])


def test_kept_scalars_made_in_inference_mode_serve_autograd_too() -> None:
    """norms.f32 keeps its constants across calls; one first made inside the forward's inference
    mode must still be usable by a caller with autograd on (an inference tensor cannot be saved
    for backward)."""
    from worker.model.norms import f32
    with torch.inference_mode():
        kept = f32(0.3125, torch.zeros(1))
    w = torch.ones(2, requires_grad=True)
    (w * kept).sum().backward()
    assert torch.equal(w.grad, torch.full((2,), 0.3125))


def test_new_request_state_is_reset(tiny, tokens, cold_run) -> None:
    """A state reused for a new request (reset) behaves like a fresh one."""
    state = tiny.new_state(BLOCK)
    tiny.prefill(tokens.flip(0), state)
    state.reset()
    assert torch.equal(tiny.prefill(tokens, state), cold_run[0])


def test_every_block_decoded_token_by_token_equals_the_prefilled_one(tiny, tokens) -> None:
    """From the first token on, decode steps only: every block boundary, every form."""
    n = 8 * BLOCK
    cold = tiny.new_state(BLOCK)
    tiny.prefill(tokens[:n], cold)
    step = tiny.new_state(BLOCK)
    for t in tokens[:n]:
        tiny.decode_step(t, step)
    for i in range(n // BLOCK):
        a, b = step.export_block(i), cold.export_block(i)
        assert a.keys() == b.keys() == set(tiny_forms(tiny))
        for form in a:
            assert torch.equal(a[form].view(torch.int32), b[form].view(torch.int32)), (i, form)


def tiny_forms(model) -> list[str]:
    from worker.model.forms import form_layouts
    return list(form_layouts(model.cfg, BLOCK))
