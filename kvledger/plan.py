"""``kvledger plan``: how much cache a model needs per token and per request, and how many
requests of which context length a memory budget holds.

The shapes come from the model's own form declaration (:func:`worker.model.forms.form_layouts`,
the same one the worker allocates its pools from), so the planner cannot drift from what the
worker stores. Only the bytes per element change with ``--dtype``:

* ``float32`` — what this worker stores today (``worker.model.forms.STATE_DTYPE``);
* ``bfloat16`` / ``float16`` — 2 bytes per element;
* ``fp8`` — DeepSeek-V4's ``fp8_ds_mla`` entry as vLLM stores it (research note §4.2): the
  non-rotary dims in fp8, the rotary dims in bf16, one 1-byte scale per 64 fp8 dims, padded
  to 8 bytes (512-dim entry: 448 + 128 + 7 + 1 = 584 B); indexer keys in fp8 plus one fp32
  scale (128-dim key: 132 B).

The compressor ``tail`` is kept at ``--state-dtype`` (default float32: every engine keeps the
compressor state in fp32).

Capacity follows the worker's own split (:func:`worker.settings.pool_slots`): the cache
budget is ``pool × cache_reserve_ratio``, where the pool is ``--memory − --weights`` (or
``worker.pool_bytes`` when no ``--memory`` is given, or — pool_bytes unset — the pool a worker
would size from this machine's memory now: :func:`worker.settings.memory_pool_bytes`); full-history forms share
``compressed_pool_limit`` with equal slot counts, the window form gets ``swa_pool_limit``,
the resume-point form ``tail_pool_limit``. A request of ``L`` tokens holds ``ceil(L/B)``
blocks of each full-history form, the blocks covering its last ``W − 1`` tokens of the
window form (at most ``ceil((W−1)/B) + 1``), and one block of the resume-point form.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GiB = 2**30
MiB = 2**20

#: Bytes per element of each storage dtype (``fp8`` entries are laid out by :func:`entry_bytes`).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
DTYPES = tuple(DTYPE_BYTES)
STATE_DTYPES = ("float32", "bfloat16", "float16")

#: Context lengths the table shows by default (those the model supports).
DEFAULT_CONTEXTS = (256, 1024, 4096, 8192, 32768, 131072, 262144, 524288, 1048576)


def _flash_ratios() -> tuple[int, ...]:
    # [0, 0, 4, 128, 4, 128, ..., 4] over 43 layers: 2 SWA, 21 CSA, 20 HCA (note §1.1; the MTP entry dropped).
    return (0, 0, *[4 if i % 2 == 0 else 128 for i in range(41)])


def _pro_ratios() -> tuple[int, ...]:
    # [128, 128, 4, 128, ..., 4] over 61 layers: 0 SWA, 30 CSA, 31 HCA (note §1.1).
    return (128, 128, *[4 if i % 2 == 0 else 128 for i in range(59)])


def _preset(name: str, layers: int, ratios: tuple[int, ...], hidden: int, heads: int, q_lora: int, o_groups: int,
            topk: int, experts: int, inter: int) -> dict[str, Any]:
    """DeepSeek-V4 sizes from research/dsv4-attention.md §1.1. ``vocab_size`` does not enter any
    cache figure (the note does not give it; the value here only satisfies the config)."""
    return dict(model_id=name, vocab_size=129280, hidden_size=hidden, num_hidden_layers=layers,
                compress_ratios=ratios, csa_ratio=4, num_attention_heads=heads, head_dim=512, qk_rope_head_dim=64,
                q_lora_rank=q_lora, o_groups=o_groups, o_lora_rank=1024, sliding_window=128, index_n_heads=64,
                index_head_dim=128, index_topk=topk, hc_mult=4, n_routed_experts=experts, num_experts_per_tok=6,
                n_shared_experts=1, moe_intermediate_size=inter,
                mlp_layer_types=("hash_moe",) * 3 + ("moe",) * (layers - 3), max_position_embeddings=1048576)


def _dense(name: str, family: str, layers: int, hidden: int, heads: int, kv_heads: int, max_pos: int,
           vocab: int, inter: int) -> dict[str, Any]:
    """A standard full-attention model's published sizes (its config.json); head_dim 128."""
    return dict(model_id=name, family=family, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128,
                max_position_embeddings=max_pos, layer_types=("full_attention",) * layers)


#: Standard models (``worker.model.dense``), by their public config.json sizes.
DENSE_PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": {},
    "llama-3.1-8b": _dense("llama-3.1-8b (preset)", "llama", 32, 4096, 32, 8, 131072, 128256, 14336),
    "llama-3.1-70b": _dense("llama-3.1-70b (preset)", "llama", 80, 8192, 64, 8, 131072, 128256, 28672),
    "qwen2.5-7b": _dense("qwen2.5-7b (preset)", "qwen2", 28, 3584, 28, 4, 32768, 152064, 18944),
    "qwen3-8b": _dense("qwen3-8b (preset)", "qwen3", 36, 4096, 32, 8, 40960, 151936, 12288),
}

#: YOCO decoder-decoders (``worker.model.yoco``): one global K/V per token plus a window.
YOCO_PRESETS: dict[str, dict[str, Any]] = {
    "yoco-tiny": {},
}
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "dsv4-flash": _preset("deepseek-v4-flash (preset)", 43, _flash_ratios(), 4096, 64, 1024, 8, 512, 256, 2048),
    "dsv4-pro": _preset("deepseek-v4-pro (preset)", 61, _pro_ratios(), 7168, 128, 1536, 16, 1024, 384, 3072),
    **DENSE_PRESETS,
    **YOCO_PRESETS,
}


class PlanError(ValueError):
    """An impossible request to the planner; the message says what is allowed."""


# --- bytes ----------------------------------------------------------------------------------------

def entry_bytes(width: int, dtype: str, rope_dims: int = 0) -> int:
    """Bytes of one ``width``-wide KV entry (compressed entry or sliding-window row)."""
    if dtype != "fp8":
        return width * DTYPE_BYTES[dtype]
    nope = width - rope_dims
    raw = nope + 2 * rope_dims + math.ceil(nope / 64)
    return -(-raw // 8) * 8


def index_key_bytes(width: int, dtype: str) -> int:
    """Bytes of one indexer key (fp8: the key plus one fp32 scale)."""
    return width + 4 if dtype == "fp8" else width * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class FormPlan:
    name: str
    scope: str
    dtype: str
    bytes_per_block: int
    #: Blocks of this form one request of ``context`` tokens holds (see module docstring).
    window_tokens: int = 0

    def bytes_per_token(self, block_size: int) -> float:
        return self.bytes_per_block / block_size


def worker_form_plans(model: Any, block_size: int, compute_dtype: str, cache_dtype: str) -> list[FormPlan]:
    """Every form exactly as a worker with ``cache.dtype: cache_dtype`` stores it (its own layouts)."""
    import torch

    from worker.model.config import ConfigError as ModelConfigError
    from worker.model.dense.state import dense_form_layouts
    from worker.model.forms import form_layouts
    from worker.model.storage import CACHE_DTYPES, StorageError

    if cache_dtype not in CACHE_DTYPES:
        raise PlanError(f"--cache-dtype {cache_dtype!r}: allowed: {', '.join(CACHE_DTYPES)}")
    if block_size <= 0:
        raise PlanError(f"--block-size must be > 0, got {block_size}")
    from worker.model.yoco.state import yoco_form_layouts
    try:
        if is_yoco(model):
            layouts = yoco_form_layouts(model, block_size, getattr(torch, compute_dtype), cache_dtype)
        elif is_dense(model):
            layouts = dense_form_layouts(model, block_size, getattr(torch, compute_dtype), cache_dtype)
        else:
            layouts = form_layouts(model, block_size, cache_dtype)
    except ModelConfigError as e:
        raise PlanError(f"--block-size: {e}") from None
    except StorageError as e:
        raise PlanError(f"--cache-dtype: {e}") from None
    return [FormPlan(n, str(lay.spec.scope), lay.spec.dtype, lay.spec.bytes_per_block, lay.spec.window_tokens)
            for n, lay in layouts.items()]


def form_plans(model: Any, block_size: int, dtype: str, state_dtype: str = "float32") -> list[FormPlan]:
    """Every form of ``model`` at ``block_size``, with its bytes per block at the given dtypes."""
    from worker.model.config import ConfigError as ModelConfigError
    from worker.model.forms import COMPRESSED, INDEXER, SWA, TAIL, form_layouts

    if dtype not in DTYPE_BYTES:
        raise PlanError(f"--dtype {dtype!r}: allowed: {', '.join(DTYPES)}")
    if state_dtype not in STATE_DTYPES:
        raise PlanError(f"--state-dtype {state_dtype!r}: allowed: {', '.join(STATE_DTYPES)}")
    if is_yoco(model):
        # the global K/V and the self-decoder's window, as the worker lays them out
        if dtype == "fp8":
            raise PlanError("--dtype fp8: plan YOCO's fp8 storage with --cache-dtype float8_e4m3fn (what the "
                            "worker stores with cache.dtype)")
        return worker_form_plans(model, block_size, dtype, "auto")
    if is_dense(model):
        # layers × 2 (K, V) × block × KV heads × head dim × dtype: the dense family's one form.
        import torch

        from worker.model.dense.state import dense_form_layouts
        if dtype == "fp8":
            raise PlanError("--dtype fp8: the dense family stores K/V in its compute dtype "
                            "(float32, bfloat16, float16)")
        if block_size <= 0:
            raise PlanError(f"--block-size must be > 0, got {block_size}")
        lay = next(iter(dense_form_layouts(model, block_size, getattr(torch, dtype)).values()))
        return [FormPlan(lay.spec.name, str(lay.spec.scope), dtype, lay.spec.bytes_per_block)]
    try:
        layouts = form_layouts(model, block_size)
    except ModelConfigError as e:
        raise PlanError(f"--block-size: {e}") from None
    out = []
    for name, lay in layouts.items():
        shape = lay.shape
        if name in (COMPRESSED, SWA):
            rows = math.prod(shape[:-1])
            nbytes = rows * entry_bytes(shape[-1], dtype, model.qk_rope_head_dim)
            dt = dtype
        elif name == INDEXER:
            nbytes = math.prod(shape[:-1]) * index_key_bytes(shape[-1], dtype)
            dt = dtype
        elif name == TAIL:
            nbytes = math.prod(shape) * DTYPE_BYTES[state_dtype]
            dt = state_dtype
        else:  # a form this planner does not know yet: its declared bytes, as stored
            nbytes, dt = lay.spec.bytes_per_block, lay.spec.dtype
        out.append(FormPlan(name, str(lay.spec.scope), dt, nbytes, lay.spec.window_tokens))
    return out


# --- capacity --------------------------------------------------------------------------------------

@dataclass
class Plan:
    model_id: str
    block_size: int
    dtype: str
    state_dtype: str
    forms: list[FormPlan]
    #: Where the budget comes from, for people.
    budget_note: str
    cache_budget_bytes: float
    limits: dict[str, float]
    max_position: int
    contexts: list[int] = field(default_factory=list)
    concurrency: int = 32
    #: The pool before the reserve ratio, and whether it is ``worker.pool_bytes``, ``memory``
    #: (sized as a worker without pool_bytes sizes it) or ``--memory``.
    pool_bytes: float = 0.0
    pool_source: str = ""
    #: The longest request a worker serves: service.max_context_length, at most the model's maximum.
    serve_context: int = 0

    # -- per form / per request ---------------------------------------------------------------

    def by_scope(self, scope: str) -> list[FormPlan]:
        return [f for f in self.forms if f.scope == scope]

    @property
    def growth_bytes_per_token(self) -> float:
        """Bytes every token adds for the whole history (compressed entries + indexer keys)."""
        return sum(f.bytes_per_token(self.block_size) for f in self.by_scope("full_history"))

    def blocks_per_request(self, form: FormPlan, context: int) -> int:
        from worker.settings import blocks_per_request

        return blocks_per_request(form.scope, form.window_tokens, self.block_size, context)

    def bounded_bytes_per_request(self) -> int:
        """Bytes a request holds whatever its length: the window rows and the resume-point tail."""
        big = 10**12
        return sum(self.blocks_per_request(f, big) * f.bytes_per_block
                   for f in self.forms if f.scope != "full_history")

    def bytes_per_request(self, context: int) -> int:
        return sum(self.blocks_per_request(f, context) * f.bytes_per_block for f in self.forms)

    # -- the pools ---------------------------------------------------------------------------

    def _fractions(self) -> dict[str, float]:
        return {"full_history": self.limits["compressed"], "window": self.limits["swa"],
                "resume_point": self.limits["tail"]}

    def slots(self) -> dict[str, int]:
        """Slots per form, split as the worker splits its pool (worker.settings.pool_slots)."""
        from worker.settings import scope_slots

        return scope_slots(self.forms, self.cache_budget_bytes, self._fractions())

    def shares(self) -> dict[str, float]:
        """Each present scope's share of the budget (absent scopes' shares redistributed)."""
        frac = {k: v for k, v in self._fractions().items() if self.by_scope(k)}
        scale = sum(self._fractions().values()) / sum(frac.values())
        return {k: v * scale for k, v in frac.items()}

    def max_concurrency(self, context: int) -> tuple[int, str]:
        """Requests of ``context`` tokens the pools hold at once, and the form that limits it
        (the worker's own count: ``worker.settings.requests_admitted``)."""
        from worker.settings import requests_admitted

        return requests_admitted(self.forms, self.slots(), self.block_size, context)

    def max_context(self, concurrency: int) -> tuple[int, str]:
        """Longest context (block multiple, ≤ the model's maximum) ``concurrency`` requests can each have."""
        if concurrency <= 0:
            return 0, ""
        lo, hi = 0, -(-self.max_position // self.block_size)
        if self.max_concurrency(self.block_size)[0] < concurrency:
            return 0, self.max_concurrency(self.block_size)[1]
        while lo < hi:  # largest block count b with max_concurrency(b·B) ≥ concurrency
            mid = (lo + hi + 1) // 2
            if self.max_concurrency(mid * self.block_size)[0] >= concurrency:
                lo = mid
            else:
                hi = mid - 1
        limit = "" if lo * self.block_size >= self.max_position else self.max_concurrency((lo + 1) * self.block_size)[1]
        return min(lo * self.block_size, self.max_position), limit or "model maximum"

    def to_dict(self) -> dict[str, Any]:
        slots = self.slots()
        return {
            "model_id": self.model_id, "block_size": self.block_size, "dtype": self.dtype,
            "state_dtype": self.state_dtype, "budget": self.budget_note,
            "cache_budget_bytes": int(self.cache_budget_bytes),
            "growth_bytes_per_token": self.growth_bytes_per_token,
            "bounded_bytes_per_request": self.bounded_bytes_per_request(),
            "forms": [{"name": f.name, "scope": f.scope, "dtype": f.dtype, "bytes_per_block": f.bytes_per_block,
                       "bytes_per_token": f.bytes_per_token(self.block_size), "window_tokens": f.window_tokens,
                       "slots": slots.get(f.name, 0)} for f in self.forms],
            "capacity": [{"context": c, "bytes_per_request": self.bytes_per_request(c),
                          "max_concurrency": self.max_concurrency(c)[0], "limited_by": self.max_concurrency(c)[1]}
                         for c in self.contexts],
            "concurrency": self.concurrency,
            "max_context_at_concurrency": self.max_context(self.concurrency)[0],
            "pool_bytes": int(self.pool_bytes), "pool_source": self.pool_source,
            "max_context": self.serve_context,
            "requests_at_max_context": self.max_concurrency(self.serve_context)[0] if self.serve_context else None,
        }


def is_dense(model: Any) -> bool:
    """A dense decoder's config (one K/V form): neither the hybrid's compress ratios nor YOCO's decoders."""
    return not hasattr(model, "compress_ratios") and not is_yoco(model)


def is_yoco(model: Any) -> bool:
    return hasattr(model, "num_cross_decoder_layers")


def load_model_config(preset: str | None, model_dir: str | None) -> Any:
    """The model's config: a preset, or a directory's ``config.json`` read exactly as the worker
    reads it (:mod:`worker.model.checkpoint`; a ``save_pretrained`` directory of any supported
    family, or kvledger's own format)."""
    from worker.model.config import ConfigError as ModelConfigError
    from worker.model.config import ModelConfig
    from worker.model.dense.config import DenseConfig

    try:
        if model_dir:
            from worker.model import checkpoint as ck
            d = Path(model_dir)
            doc = ck.read_config(d)
            family = ck.family_of(doc)
            if family == "kvledger":
                return ck.native_config(doc)
            if family == "deepseek_v4":
                return ck.dsv4_config(doc, ck.model_id_for(d, doc))
            if family == "yoco":
                from worker.model.yoco.checkpoint import yoco_config
                return yoco_config(doc, ck.model_id_for(d, doc))
            return ck.dense_config(doc, family, ck.model_id_for(d, doc))
        name = preset or "tiny"
        if name not in PRESETS:
            raise PlanError(f"--model {name!r}: allowed: {', '.join(PRESETS)} (or --model-dir DIR)")
        if name in YOCO_PRESETS:
            from worker.model.yoco import YocoConfig
            return YocoConfig(**PRESETS[name])
        return DenseConfig(**PRESETS[name]) if name in DENSE_PRESETS else ModelConfig(**PRESETS[name])
    except ModelConfigError as e:
        raise PlanError(f"model config: {e}") from None


def model_dtype(preset: str | None, model_dir: str | None) -> str | None:
    """The dtype a dense model computes (and stores K/V) in: its config's, else bfloat16 for presets."""
    if model_dir:
        from worker.model import checkpoint as ck
        doc = ck.read_config(Path(model_dir))
        return None if ck.family_of(doc) in ("kvledger", "deepseek_v4") else \
            str(ck.checkpoint_dtype(doc)).removeprefix("torch.")
    if preset in ("llama-tiny", "yoco-tiny"):
        return "float32"
    return "bfloat16" if preset in DENSE_PRESETS else None


def default_block_size(model: Any, wanted: int) -> int:
    """``wanted`` rounded up to a multiple of every compress ratio (blocks must end on a
    compression boundary of every layer)."""
    step = math.lcm(*[r for r in getattr(model, "compress_ratios", ()) if r] or [1])
    return -(-wanted // step) * step


def weights_bytes(preset: str | None, model_dir: str | None) -> int | None:
    """The checkpoint's size when it can be known here: the safetensors files of ``model_dir``,
    or the tiny model's parameters. None for a preset (give --weights)."""
    if model_dir:
        files = list(Path(model_dir).glob("*.safetensors"))
        return sum(f.stat().st_size for f in files) if files else None
    if (preset or "tiny") in ("tiny", "llama-tiny", "yoco-tiny"):
        from worker.model import build_model
        from worker.model.dense import build_dense
        from worker.model.yoco import build_yoco

        model = build_dense() if preset == "llama-tiny" else build_yoco() if preset == "yoco-tiny" else build_model(seed=0)
        return sum(p.numel() * p.element_size() for p in model.parameters())
    return None


# --- the command -----------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", choices=list(PRESETS), default=None,
                   help="a named model (default: worker.model_dir of the config, else tiny)")
    p.add_argument("--model-dir", help="a checkpoint directory as worker.model_dir (a save_pretrained directory of "
                                       "DeepSeek-V4, Llama, Qwen2 or Qwen3, or kvledger's own format)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="storage dtype of the KV forms (default: a dense model's own dtype; float32 for the "
                        "hybrid tiny/--model-dir — what this worker stores — and bfloat16 for the presets)")
    p.add_argument("--state-dtype", choices=STATE_DTYPES, default="float32", help="dtype of the compressor tail")
    p.add_argument("--cache-dtype", default=None, metavar="DTYPE",
                   help="plan every form exactly as a worker with this cache.dtype stores it (auto, float32, "
                        "bfloat16, float16, float8_e4m3fn; default: the config's cache.dtype when it is not auto "
                        "and no --dtype is given)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per block (default: cache.block_size rounded up to a multiple of every ratio)")
    p.add_argument("--memory", type=float, default=None, metavar="GiB",
                   help="device memory per worker; default: plan for worker.pool_bytes of the config, or "
                        "(unset) for the pool a worker sizes from this machine's memory")
    p.add_argument("--weights", type=float, default=None, metavar="GiB",
                   help="memory the weights take (default: the model dir's safetensors, the tiny model's "
                        "parameters; required for a preset with --memory)")
    p.add_argument("--reserve", type=float, default=None, metavar="RATIO",
                   help="share of the pool given to cached forms (default: service.cache_reserve_ratio)")
    p.add_argument("--context", type=int, action="append", metavar="TOKENS",
                   help="context lengths for the table (repeatable; default: a range up to the model's maximum)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="also report the longest context this many requests can each have "
                        "(default: service.max_concurrency)")


def build_plan(args: argparse.Namespace, cfg: Any) -> Plan:
    preset = args.model
    model_dir = args.model_dir or (None if preset else cfg.worker.model_dir or None)
    if preset and args.model_dir:
        raise PlanError("give --model or --model-dir, not both")
    model = load_model_config(preset, model_dir)
    dtype = args.dtype or model_dtype(preset, model_dir) or ("bfloat16" if preset and preset != "tiny" else "float32")
    block_size = args.block_size or default_block_size(model, cfg.cache.block_size)
    reserve = cfg.service.cache_reserve_ratio if args.reserve is None else args.reserve
    if not 0 < reserve <= 1:
        raise PlanError(f"--reserve {reserve}: a share in (0, 1]")
    cache_dtype = getattr(args, "cache_dtype", None) or (
        cfg.cache.dtype if cfg.cache.dtype != "auto" and not args.dtype else None)
    if cache_dtype:
        compute = model_dtype(preset, model_dir) or "float32"
        forms = worker_form_plans(model, block_size, compute, cache_dtype)
        dtype = forms[0].dtype if len({f.dtype for f in forms}) == 1 else cache_dtype
    else:
        forms = form_plans(model, block_size, dtype, args.state_dtype)
    max_pos = model.max_position_embeddings
    if args.memory is None and cfg.worker.pool_bytes is not None:
        pool, source = float(cfg.worker.pool_bytes), "worker.pool_bytes"
        note = f"worker.pool_bytes {fmt_bytes(pool)} × reserve {reserve}"
    elif args.memory is None:
        from worker.settings import concurrency_floor

        floor = concurrency_floor(forms, cfg, block_size, min(cfg.service.max_context_length, max_pos))
        pool, note = memory_pool(cfg, preset, model_dir, floor)
        source, note = "memory", f"{note} × reserve {reserve}"
    else:
        source = "--memory"
        if args.weights is not None:
            weights = args.weights * GiB
        else:
            known = weights_bytes(preset, model_dir)
            if known is None:
                raise PlanError(f"--weights GiB is needed with --memory for {preset or model_dir} "
                                f"(the memory the checkpoint takes on the device)")
            weights = float(known)
        pool = args.memory * GiB - weights
        if pool <= 0:
            raise PlanError(f"--memory {args.memory:g} GiB leaves nothing after the weights ({fmt_bytes(weights)})")
        note = f"(memory {args.memory:g} GiB − weights {fmt_bytes(weights)}) × reserve {reserve}"
    contexts = sorted(set(args.context)) if args.context else \
        [c for c in DEFAULT_CONTEXTS if block_size <= c <= max_pos]
    limits = {"compressed": cfg.cache.compressed_pool_limit, "swa": cfg.cache.swa_pool_limit,
              "tail": cfg.cache.tail_pool_limit}
    state_dtype = next((f.dtype for f in forms if f.scope == "resume_point"), args.state_dtype) if cache_dtype \
        else args.state_dtype
    return Plan(model.model_id, block_size, dtype, state_dtype, forms, note, pool * reserve, limits, max_pos,
                contexts, args.concurrency or cfg.service.max_concurrency, pool, source,
                min(cfg.service.max_context_length, max_pos))


def memory_pool(cfg: Any, preset: str | None, model_dir: str | None,
                floor: tuple[int, str] = (0, "")) -> tuple[float, str]:
    """The pool a worker without ``worker.pool_bytes`` would size on this machine now: the memory
    available (less the weights it has yet to load) × ``worker.cache_memory_fraction``, capped on
    a CPU but never below ``floor`` (:func:`worker.settings.memory_pool_bytes`, what the worker
    itself calls)."""
    from worker.settings import available_memory, memory_pool_bytes

    try:
        free, where = available_memory(cfg.worker.device)
    except (RuntimeError, AssertionError) as e:   # no such CUDA device here
        raise PlanError(f"worker.pool_bytes is unset and {cfg.worker.device} cannot be read here ({e}): "
                        f"give --memory GiB or set worker.pool_bytes") from None
    weights = weights_bytes(preset, model_dir)
    counted = f"weights {fmt_bytes(weights)}" if weights is not None else "weights not counted: give --memory/--weights"
    pool, how = memory_pool_bytes(cfg, cfg.worker.device, max(0, free - (weights or 0)), floor)
    return float(pool), f"memory-sized: ({fmt_bytes(free)} {where} − {counted}) × " + how.split(" × ", 1)[1]


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def run_plan_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from shared.config import load_config

    cfg = load_config(getattr(args, "config", None))
    try:
        plan = build_plan(args, cfg)
    except PlanError as e:
        print(f"kvledger plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    con = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    bs = plan.block_size
    tail = "" if not plan.by_scope("resume_point") else f", compressor tail in {plan.state_dtype}"
    con.print(f"[bold]{plan.model_id}[/bold]: block {bs} tokens, KV forms in {plan.dtype}{tail}")
    slots = plan.slots()
    t = Table(title="cache forms", title_justify="left")
    for col in ("form", "scope", "dtype", "bytes/block", "bytes/token", "per request", "pool slots"):
        t.add_column(col, justify="left" if col in ("form", "scope", "dtype") else "right")
    for f in plan.forms:
        if f.scope == "full_history":
            per_req = "grows with context"
        else:
            per_req = fmt_bytes(plan.blocks_per_request(f, 10**12) * f.bytes_per_block)
            per_req += f" ({plan.blocks_per_request(f, 10**12)} blk)"
        t.add_row(f.name, f.scope, f.dtype, f"{f.bytes_per_block:,}", f"{f.bytes_per_token(bs):,.2f}", per_req,
                  f"{slots.get(f.name, 0):,}")
    con.print(t)
    con.print(f"full history grows [bold]{plan.growth_bytes_per_token:,.2f} B/token[/bold] "
              f"({fmt_bytes(plan.growth_bytes_per_token * 2**20)} per 1M tokens); bounded per request: "
              f"{fmt_bytes(plan.bounded_bytes_per_request())} (window + tail)")
    shares = {name: f"{share:.2f}".rstrip("0").rstrip(".") for name, share in plan.shares().items()}
    con.print(f"cache budget: {fmt_bytes(plan.cache_budget_bytes)} = {plan.budget_note}, split "
              + " / ".join(f"{scope} {share}" for scope, share in shares.items()))
    c = Table(title="concurrency × context length", title_justify="left")
    for col in ("context (tokens)", "cache per request", "max concurrent requests", "limited by"):
        c.add_column(col, justify="right" if col != "limited by" else "left")
    for ctx in plan.contexts:
        n, form = plan.max_concurrency(ctx)
        c.add_row(f"{ctx:,}", fmt_bytes(plan.bytes_per_request(ctx)), f"{n:,}", f"{form} pool")
    con.print(c)
    longest, why = plan.max_context(plan.concurrency)
    con.print(f"{plan.concurrency} concurrent requests: up to [bold]{longest:,}[/bold] tokens each"
              + (f" (limited by the {why}{' pool' if why != 'model maximum' else ''})" if why else ""))
    n, form = plan.max_concurrency(plan.serve_context)
    con.print(f"requests of the maximum context ({plan.serve_context:,} tokens) held at once: [bold]{n:,}[/bold] "
              f"(limited by the {form} pool)" + ("" if n or plan.pool_source != "memory" else
                                                 " — a worker sized from memory refuses to start"))
    return 0
