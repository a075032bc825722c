"""Model benchmark: cold vs warm time to first token, and decode speed (CPU, tiny config).

``--family`` picks the model: ``hybrid`` (the DeepSeek-V4-style default), or a tiny dense
``llama`` / ``qwen2`` (q/k/v biases, sliding layers) / ``qwen3`` (QK-norm) with seeded weights;
``--model-dir`` benchmarks a checkpoint directory instead, ``--dtype`` its compute dtype.

Cold: a fresh request prefills the whole prompt (2,048 tokens) and produces the last
token's logits. Warm: a fresh request restores the cached blocks of the largest block
boundary <= the cached length (1,900 -> 1,888 with 16-token blocks) and prefills only the
rest. ``ideal_speedup`` is the compute ratio ``prompt / uncached tokens``;
``speedup_vs_ideal`` = measured / ideal. The warm logits must equal the cold ones bit for
bit (``warm_bit_identical``). Decode is timed after 256 and after 2,048 tokens.

``cache_dtype_drift``: for each low storage precision (``cache.dtype``), the bytes per block
against float32 storage and the logit drift against float32 storage over a 1,024-token
prompt (max/mean |Δlogit|, KL, top-1 agreement), and whether a warm run at that precision
equals its own cold run (``fp8_cache_bytes_ratio``: the fp8 bytes ratio, scales included).

    python -m bench.model            # full: more repetitions
    python -m bench.model --quick    # within 60 s

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from worker.model import ModelConfig, build_model
from worker.model.dense import DenseConfig, build_dense

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dense_tiny(family: str) -> DenseConfig:
    """The tiny dense config of each family (same sizes; the family's own features switched on)."""
    extra = {"llama": {}, "qwen2": {"qkv_bias": True, "sliding_window": 256,
                                    "layer_types": ("full_attention", "sliding_attention") * 2},
             "qwen3": {"qk_norm": True}}[family]
    return DenseConfig(model_id=f"kvledger/{family}-tiny", family=family, **extra)


def load(args):
    if args.model_dir:
        from worker.model.checkpoint import load_checkpoint
        return load_checkpoint(args.model_dir, dtype=args.dtype or "auto").model
    dtype = DTYPES[args.dtype or "float32"]
    if args.family == "hybrid":
        return build_model(ModelConfig(), seed=args.seed).to(dtype)
    if args.family == "yoco":
        from worker.model.yoco import build_yoco
        return build_yoco(seed=args.seed, dtype=dtype)
    return build_dense(dense_tiny(args.family), seed=args.seed, dtype=dtype)


def yoco_vs_standard(yoco, bs: int, n_tokens: int, reps: int) -> dict:
    """YOCO against a standard decoder of the same depth and width (every layer full attention,
    the same heads, K/V heads, head dim and MLP), on the same long prompt.

    * prefill: a cold prefill producing the last token's logits, in 256-token pieces as a
      worker runs it, timed interleaved, medians (ideal ≈ self-decoder layers / all layers: a
      prompt's tokens skip the cross-decoder; the self-decoder's windowed attention costs less
      than full attention on long prompts, so it can do better than that);
    * cache bytes per token at that context: YOCO's global K/V for every token plus its window
      form's blocks (a resume needs only those), against the standard model's K/V of every
      layer for every token (ideal = 1 / layers, plus the window).
    """
    from worker.model.dense.state import dense_form_layouts
    from worker.model.yoco import GLOBAL_KV, SWA

    c = yoco.cfg
    std = build_dense(DenseConfig(model_id="kvledger/standard-like-yoco", vocab_size=c.vocab_size,
                                  hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                                  num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                                  num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                                  max_position_embeddings=max(c.max_position_embeddings, n_tokens + bs),
                                  layer_types=("full_attention",) * c.num_hidden_layers),
                      seed=1, dtype=yoco.dtype)
    prompt = torch.randint(0, c.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(11))
    cap = -(-(n_tokens + 1) // bs) * bs
    # in 256-token pieces, as a worker's stepper ran them until stop 42 raised service.max_batch_tokens
    # to 1,024 (kept, so the recorded figures compare): each piece's last row goes through the
    # cross-decoder, and a windowed layer reads its window, not the history
    units = max(1, 256 // bs)
    t_yoco, t_std = [], []
    for _ in range(reps):
        t_yoco.append(_timed(lambda: yoco.prefill(prompt, yoco.new_state(bs, cap), chunk_blocks=units,
                                                  logits="last"))[0])
        t_std.append(_timed(lambda: std.prefill(prompt, std.new_state(bs, cap), chunk_blocks=units,
                                                logits="last"))[0])
    lay = yoco.form_layouts(bs)
    g, w = lay[GLOBAL_KV].spec, lay[SWA].spec
    window_blocks = min(-(-n_tokens // bs), -(-w.window_tokens // bs) + 1)
    yoco_bytes = -(-n_tokens // bs) * g.bytes_per_block + window_blocks * w.bytes_per_block
    std_bytes = -(-n_tokens // bs) * next(iter(dense_form_layouts(std.cfg, bs, std.dtype).values())).spec.bytes_per_block
    L = c.num_hidden_layers
    return {
        "yoco_layers": f"{c.num_self_decoder_layers} self + {c.num_cross_decoder_layers} cross",
        "yoco_prompt_tokens": n_tokens,
        "yoco_prefill_ms": round(statistics.median(t_yoco), 2),
        "standard_prefill_ms": round(statistics.median(t_std), 2),
        "yoco_prefill_ratio_vs_standard": round(statistics.median(t_yoco) / statistics.median(t_std), 3),
        "yoco_prefill_ratio_ideal": round(c.num_self_decoder_layers / L, 3),
        "yoco_cache_bytes_per_token_vs_standard": round(yoco_bytes / std_bytes, 4),
        "yoco_cache_bytes_per_token_ideal": round(1 / L + window_blocks * w.bytes_per_block / std_bytes, 4),
    }


#: SmolLM2-135M's products in one forward, as ``(in, out)``: 30 layers of q, k, v, o, gate, up,
#: down (hidden 576, 9 heads and 3 K/V heads of 64, intermediate 1,536), then the tied head.
SMOLLM2_LAYER = ((576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576))
SMOLLM2_PRODUCTS = (*SMOLLM2_LAYER * 30, (576, 49152))


def invariant_linear_vs_plain(reps: int, rows=(1, 8, 64), dtypes=("float32", "bfloat16")) -> dict:
    """SmolLM2-135M's products (random weights of its shapes, 538 MB in float32) at ``rows`` rows,
    through ``kernels.invariant.linear`` against plain ``F.linear`` with every core as torch's
    intra-op threads (not invariant; the memory floor at one row), and against the padded path
    the compiled product replaced (one intra-op thread, its row floor calibrated at these shapes).
    Best of ``reps``, interleaved so that each rep samples the same load.

    NOTE: the ratios divide by the faster of plain ``F.linear`` on every core and on one: on a
    machine shared with other work, MKL's threads wait at each barrier for a descheduled peer
    (8 rows once took 6.7 s there against 0.25 s on one thread), which would flatter the ratio."""
    import os

    import torch.nn.functional as F

    import kernels.invariant as inv
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    ratio: dict = {}
    old_ratio: dict = {}
    ms: dict = {}
    for name in dtypes:
        dt = DTYPES[name]
        g = torch.Generator().manual_seed(0)
        ws = [(torch.randn(n, k, generator=g) * k ** -0.5).to(dt) for k, n in SMOLLM2_PRODUCTS]
        torch.set_num_threads(1)
        with inv.padded_products():
            failures = inv.calibrate(set(SMOLLM2_LAYER), dtype=dt)
            floor = inv.MIN_ROWS
        ratio[name], old_ratio[name], ms[name] = {}, {}, {"padded_row_floor": floor,
                                                          "padded_probe_failures": len(failures)}
        for m in rows:
            xs = {k: torch.randn(m, k, generator=g).to(dt) for k in (576, 1536)}

            def step(fn, xs=xs):
                for (k, _), w in zip(SMOLLM2_PRODUCTS, ws):
                    fn(xs[k], w)
            best = {"compiled": [], "padded": [], "plain": [], "plain_1thread": []}
            for _ in range(reps):
                torch.set_num_threads(1)
                best["compiled"].append(_timed(lambda: step(inv.linear))[0])
                with inv.padded_products(floor):
                    best["padded"].append(_timed(lambda: step(inv.linear))[0])
                best["plain_1thread"].append(_timed(lambda: step(F.linear))[0])
                torch.set_num_threads(cores)
                best["plain"].append(_timed(lambda: step(F.linear))[0])
            b = {k: min(v) for k, v in best.items()}
            plain = min(b["plain"], b["plain_1thread"])
            ratio[name][m] = round(b["compiled"] / plain, 3)
            old_ratio[name][m] = round(b["padded"] / plain, 3)
            ms[name][m] = {k: round(v, 2) for k, v in b.items()}
        del ws
    torch.set_num_threads(threads)
    return {"invariant_linear_vs_plain": ratio, "invariant_linear_padded_vs_plain": old_ratio,
            "invariant_linear_ms": ms, "invariant_linear_path": inv.linear_path(), "invariant_linear_cores": cores}


def _timed(fn) -> tuple[float, float, object]:
    """(wall ms, process CPU ms, result) of one call (a CUDA device is synchronised first and after)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - w0) * 1000, (time.process_time() - c0) * 1000, out


def storage_drift(model, bs: int, prompt: torch.Tensor, n_tokens: int) -> dict:
    """What each ``cache.dtype`` costs in logits and buys in bytes, against float32 storage.

    One cold prefill of ``n_tokens`` per precision (every position's logits: a request reads
    its own rows as stored, so the drift grows along the prompt); then a warm run at that
    precision, resumed from its own exported blocks, must equal its own cold run bit for bit.
    """
    from worker.model.storage import StorageError

    toks = prompt[:n_tokens]
    cap = -(-(n_tokens + 1) // bs) * bs
    out: dict = {}

    def cold(dt):
        st = model.new_state(bs, cap, cache_dtype=dt)
        return model.prefill(toks, st), st

    ref, ref_state = cold("float32")
    f32_bytes = sum(lay.spec.bytes_per_block for lay in ref_state.layouts.values())
    p_ref = torch.log_softmax(ref.float(), -1)
    for dt in ("bfloat16", "float16", "float8_e4m3fn"):
        try:
            logits, st = cold(dt)
        except StorageError as e:
            out[dt] = {"skipped": str(e)}
            continue
        d = (logits.float() - ref.float()).abs()
        p = torch.log_softmax(logits.float(), -1)
        kl = (p_ref.exp() * (p_ref - p)).sum(-1)
        n = st.completed_blocks - 1
        warm = model.new_state(bs, cap, cache_dtype=dt)
        warm.restore([st.export_block(i) for i in range(n)], n)
        again = model.prefill(toks[n * bs:], warm)
        out[dt] = {
            "bytes_ratio_vs_float32": round(sum(lay.spec.bytes_per_block for lay in st.layouts.values()) / f32_bytes, 4),
            "logit_max_abs_diff": float(d.max()),
            "logit_mean_abs_diff": float(d.mean()),
            "logit_max_abs_diff_rel": float(d.max() / ref.float().abs().max()),
            "kl_mean": float(kl.mean()),
            "top1_agreement": float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
            "warm_bit_identical": bool(torch.equal(again, logits[n * bs:])),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions; finishes within 60 s")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--cached", type=int, default=1900, help="cached prefix tokens (default 1900)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="torch device for the model and its states (default cpu)")
    ap.add_argument("--family", choices=("hybrid", "llama", "qwen2", "qwen3", "yoco"), default="hybrid",
                    help="the model family (default hybrid: the DeepSeek-V4-style tiny model; yoco adds the "
                         "comparison with a standard decoder of the same depth and width)")
    ap.add_argument("--model-dir", help="benchmark this checkpoint directory (as worker.model_dir) instead")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                    help="compute dtype (default: float32, or the checkpoint's own with --model-dir)")
    ap.add_argument("--products-only", action="store_true",
                    help="only invariant_linear_vs_plain (SmolLM2-135M's products; both dtypes)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.products_only:
        result = invariant_linear_vs_plain(3 if args.quick else 7)
        print(json.dumps(result))
        return result
    cold_reps, warm_reps, decode_steps = (2, 8, 16) if args.quick else (5, 25, 64)

    model = load(args).to(args.device)
    cfg = model.cfg
    invariance_failures = model.check_invariance()   # fused forwards are established on the CPU only
    bs = args.block_size
    capacity = -(-(args.prompt + decode_steps + 1) // bs) * bs
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(args.seed + 1))
    n_cached = args.cached // bs                       # largest block boundary <= cached
    P = n_cached * bs

    # Warm-up (first-call allocations), not timed.
    model.prefill(prompt[:2 * bs], model.new_state(bs, capacity), logits="last")

    # The cache: a cold run's exported blocks below the largest boundary <= --cached.
    cold_state = model.new_state(bs, capacity)
    cold_logits = model.prefill(prompt, cold_state, logits="last")
    blocks = [cold_state.export_block(i) for i in range(n_cached)]

    def cold():
        return model.prefill(prompt, model.new_state(bs, capacity), logits="last")

    restore_times = []

    def warm():
        state = model.new_state(bs, capacity)
        t0 = time.perf_counter()
        state.restore(blocks, n_cached)
        restore_times.append((time.perf_counter() - t0) * 1000)
        return model.prefill(prompt[P:], state, logits="last")

    # NOTE: cold and warm runs are interleaved so that both sides sample the same load on
    # a machine shared with other work; the headline uses medians (best-of would favour
    # the short warm runs, which are likelier to fit in a quiet moment). Process CPU time
    # is reported as a cross-check that does not count time spent descheduled.
    cold_wall, cold_cpu, warm_wall, warm_cpu, identical = [], [], [], [], True
    for _ in range(cold_reps):
        w, c, out = _timed(cold)
        cold_wall.append(w), cold_cpu.append(c)
        identical &= torch.equal(out, cold_logits)
        for _ in range(warm_reps // cold_reps):
            w, c, out = _timed(warm)
            warm_wall.append(w), warm_cpu.append(c)
            identical &= torch.equal(out, cold_logits)
    cold_ms, warm_ms = statistics.median(cold_wall), statistics.median(warm_wall)

    def decode_ms(state) -> float:
        toks = torch.randint(0, cfg.vocab_size, (decode_steps,), generator=torch.Generator().manual_seed(7))
        return statistics.median(_timed(lambda: model.decode_step(t, state))[0] for t in toks)

    dec_2048 = decode_ms(cold_state)
    short = model.new_state(bs, capacity)
    model.prefill(prompt[:256], short, logits="last")
    dec_256 = decode_ms(short)

    # Batched decode: one forward for B requests (each at 256 tokens of history) vs one request.
    # NOTE: the sizes take turns, step by step (the order rotating), so that the ratios compare
    # the same minutes of this machine: timed one size after the other, a slow phase that fell on
    # the batch-32 steps alone put the ratio at 3.25 in one run and 2.07-2.36 in others.
    sizes = (1, 8, 32) if model.batch_invariant else ()
    batches: dict[int, tuple[list[int], list]] = {}
    for B in sizes:
        states = []
        for b in range(B):
            st = model.new_state(bs, capacity)
            st.restore([short.export_block(i) for i in range(256 // bs)], 256 // bs)
            states.append(st)
        toks = [int(t) for t in torch.randint(0, cfg.vocab_size, (B,), generator=torch.Generator().manual_seed(B))]
        batches[B] = (toks, states)
    times: dict[int, list[float]] = {B: [] for B in sizes}
    outs: dict[int, list[torch.Tensor]] = {}
    for step in range(decode_steps // 2):
        for B in sizes[step % len(sizes):] + sizes[:step % len(sizes)]:
            toks, states = batches[B]
            for st in states:
                st.pos = 256                            # the same step again (rewrites the same rows)
            w, _, outs[B] = _timed(lambda toks=toks, states=states: model.forward_batch(
                [([t], st) for t, st in zip(toks, states)]))
            times[B].append(w)
    batch_ms = {B: statistics.median(v) for B, v in times.items()}
    batch_identical = True
    for B, (toks, states) in batches.items():
        for st in states:
            st.pos = 256
        alone = model.forward_batch([([toks[-1]], states[-1])])[0]
        batch_identical &= torch.equal(alone, outs[B][-1])
    del batches

    # The run-time check (service.fused_check_every, worker.stepper): one check is a copy of one
    # request's state and that request's forward alone, against the fused forward it checks.
    check = {}
    if batch_ms:
        from shared.config import ServiceConfig
        every = ServiceConfig().fused_check_every
        states = [model.new_state(bs, capacity) for _ in range(8)]
        for st in states:
            model.prefill(prompt[:256], st, logits="last")
        fused_ms, check_ms = [], []
        for k in range(5 if args.quick else 15):
            fork_t, _, copy = _timed(lambda k=k: states[k % 8].fork())
            alone_t, _, _ = _timed(lambda copy=copy, k=k: model.forward_batch([([k], copy)]))
            check_ms.append(fork_t + alone_t)
            fused_ms.append(_timed(lambda k=k: model.forward_batch([([k], st) for st in states]))[0])
        check = {"fused_check_ms": round(statistics.median(check_ms), 2),
                 "fused_forward_ms_batch8": round(statistics.median(fused_ms), 2),
                 "fused_check_every": every,
                 # the share of decode time the check adds at that rate, 8 requests per forward
                 "fused_check_overhead": round(statistics.median(check_ms) / (every * statistics.median(fused_ms)), 4)
                 if every else 0.0}

    # What invariance costs one request alone: the same cold prefill + decode with plain ops.
    from kernels.invariant import plain_ops

    def single() -> None:
        st = model.new_state(bs, capacity)
        model.prefill(prompt[:256], st, logits="last")
        for t in range(16):
            model.decode_step(t, st)

    inv_ms, plain_ms = [], []
    for _ in range(3 if args.quick else 7):
        inv_ms.append(_timed(single)[0])
        with plain_ops():
            plain_ms.append(_timed(single)[0])

    # Exactness of larger prefill units: 4-block units vs 1-block units on 256 tokens.
    ref = model.prefill(prompt[:256], model.new_state(bs, capacity))
    big = model.prefill(prompt[:256], model.new_state(bs, capacity), chunk_blocks=4)

    drift = storage_drift(model, bs, prompt, 256 if args.quick else 1024)
    yoco = (yoco_vs_standard(model, bs, 2048 if args.quick else 4096, 3 if args.quick else 5)
            if model.family == "yoco" else {})
    # the batch-invariant product vs plain F.linear on every core at SmolLM2-135M's shapes (issue 53;
    # goal <= 1.2 at 1, 8 and 64 rows), and the padded path it replaced
    products = invariant_linear_vs_plain(2 if args.quick else 5) if args.device == "cpu" else {}

    ideal = args.prompt / (args.prompt - P)
    speedup = cold_ms / warm_ms
    result = {
        "family": model.family,
        "model_id": cfg.model_id,
        "dtype": str(model.dtype).removeprefix("torch."),
        "prompt_tokens": args.prompt,
        "cached_tokens": P,
        "block_size": bs,
        "threads": args.threads,
        "ttft_cold_ms": round(cold_ms, 2),
        "ttft_warm_ms": round(warm_ms, 2),
        "ttft_cold_ms_best": round(min(cold_wall), 2),
        "ttft_warm_ms_best": round(min(warm_wall), 2),
        "restore_ms": round(statistics.median(restore_times), 2),
        "warm_speedup": round(speedup, 3),
        "ideal_speedup": round(ideal, 3),
        "speedup_vs_ideal": round(speedup / ideal, 3),
        "cpu_speedup": round(statistics.median(cold_cpu) / statistics.median(warm_cpu), 3),
        "cpu_speedup_vs_ideal": round(statistics.median(cold_cpu) / statistics.median(warm_cpu) / ideal, 3),
        "warm_bit_identical": bool(identical),
        "decode_ms_per_token": round(dec_2048, 2),
        "decode_ms_per_token_256": round(dec_256, 2),
        "decode_ms_per_token_2048": round(dec_2048, 2),
        "unit4_bit_identical_to_unit1": bool(torch.equal(ref, big)),
        "unit4_max_abs_diff": float((ref - big).abs().max()),
        **({"decode_step_ms_batch1": round(batch_ms[1], 2),
            "decode_step_ms_batch8": round(batch_ms[8], 2),
            "decode_step_ms_batch32": round(batch_ms[32], 2),
            # one forward of 32 requests' decode tokens vs one of a single request's (goal <= 3)
            "decode_ms_per_token_batch32_vs_batch1": round(batch_ms[32] / batch_ms[1], 3),
            "decode_tokens_per_s_batch32_vs_batch1": round(32 * batch_ms[1] / batch_ms[32], 2),
            "batched_bit_identical": bool(batch_identical)} if batch_ms else
           {"batching": "off: " + "; ".join(invariance_failures)}),
        **check,
        "device": args.device,
        "batch_invariant_slowdown": round(statistics.median(inv_ms) / statistics.median(plain_ms), 3),
        # cache.dtype: bytes per block against float32 storage (goal for fp8: <= 0.27, scales
        # included) and the logit drift each precision costs (issue 18)
        "fp8_cache_bytes_ratio": drift.get("float8_e4m3fn", {}).get("bytes_ratio_vs_float32"),
        "bf16_cache_bytes_ratio": drift.get("bfloat16", {}).get("bytes_ratio_vs_float32"),
        "cache_dtype_drift": drift,
        "cache_dtype_warm_bit_identical": all(v.get("warm_bit_identical", True) for v in drift.values()),
        **yoco,
        **products,
        "mode": "quick" if args.quick else "full",
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
