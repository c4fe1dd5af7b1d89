#!/usr/bin/env python3
"""Writes docs/benchmarks.md from the benchmark record (stdlib only):

  python3 bench/gen_benchmarks_md.py                    # writes docs/benchmarks.md
  python3 bench/gen_benchmarks_md.py --out FILE         # writes FILE instead
  python3 bench/gen_benchmarks_md.py --update-manifest  # refreshes MANIFEST.json from the files first

The record is bench/results: JSON-lines files whose rows follow bench/record.py,
folders of raw logs, and MANIFEST.json, which lists every file and names the
capabilities each one backs. For each capability below the page shows the rows
of the newest file that backs it (newest date, then MANIFEST's "recorded"), the
peer's rows of the same call beside them, the device, commit and the command
that reproduces them. Numbers are printed exactly as the rows hold them. The
hand-written part (methodology, how to read the tables) is
bench/benchmarks_header.md.
"""
import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
MANIFEST = os.path.join(RESULTS, "MANIFEST.json")
HEADER = os.path.join(ROOT, "bench", "benchmarks_header.md")
DOC = os.path.join(ROOT, "docs", "benchmarks.md")


def is_peer(r):
    return "peer" in r


def peer_decode(r):
    return is_peer(r) and r.get("mode") == "decode" and "shared-prefix" not in r["peer"]


def peer_shared(r):
    return is_peer(r) and "shared-prefix" in r["peer"]


def engine(r, mode, policy=None):
    return not is_peer(r) and r.get("mode") == mode and (policy is None or r.get("kv_policy") == policy)


# Each capability: id (the MANIFEST "backs" name), title (the section), what it
# shows, the rows of a file it takes, the columns it prints, and how to
# reproduce it. group: take the newest file per value of this field (of our
# rows) instead; need_peer: only files with the peer's rows at that value.
CAPABILITIES = [
    dict(id="decode-shadowkv", title="ShadowKV decode beside the peer",
         what="ShadowKV decode (the defaults) at 124928 tokens, natural and forced-60% hit rates, "
              "between peer runs (`--graph`) of the same call.",
         rows=lambda r: peer_decode(r) or engine(r, "decode", "shadowkv"),
         cols=["variant", "run", "round", "context", "batch", "force_hit_rate", "hit_rate", "tokens_per_s", "ms_per_step"],
         reproduce="bash ops/device/bench.sh shadowkv  # the defaults; VARIANTS=... bash ops/device/bench.sh variants for flag sets"),
    dict(id="decode-full", title="Full-attention decode beside the peer", group="context", need_peer=True,
         what="Full-attention decode (KV in HBM) beside the peer's decode in the same call: the newest "
              "file per context that has both.",
         rows=lambda r: peer_decode(r) or engine(r, "decode", "full"),
         cols=["variant", "context", "batch", "tokens_per_s", "ms_per_step", "hbm_roofline_fraction"],
         reproduce="bash ops/device/bench.sh full"),
    dict(id="prefill", title="Prefill",
         what="Time to prefill one prompt (full attention) beside the peer's SDPA prefill.",
         rows=lambda r: r.get("mode") == "prefill",
         cols=["kv_policy", "context", "batch", "prefill_chunk", "seconds"],
         reproduce="bash ops/device/bench.sh full"),
    dict(id="prefill-shadowkv", title="ShadowKV prefill",
         what="Prefill of one prompt under ShadowKV (`--profile`): the time, and the share of it spent "
              "building the shadow (SVD, landmarks, outliers, offload: `compression_fraction`).",
         rows=lambda r: engine(r, "prefill", "shadowkv"),
         cols=["context", "batch", "prefill_chunk", "seconds", "compression_fraction"],
         reproduce="penumbra-bench prefill --kv-policy shadowkv --context 124928 --profile  # on the GPU machine"),
    dict(id="shadowkv-1m", title="ShadowKV at 1M tokens",
         what="ShadowKV decode of one sequence of 1048576 tokens (full attention does not fit).",
         rows=lambda r: engine(r, "decode", "shadowkv") and r.get("context", 0) >= 1048576,
         cols=["context", "batch", "force_hit_rate", "hit_rate", "tokens_per_s", "ms_per_step"],
         reproduce="bash ops/device/bench.sh 1m"),
    dict(id="shadowkv-sweep", title="ShadowKV context and batch sweep",
         what="ShadowKV decode over contexts and batch sizes, beside the peer at each context.",
         rows=lambda r: peer_decode(r) or engine(r, "decode", "shadowkv"),
         cols=["context", "batch", "force_hit_rate", "hit_rate", "tokens_per_s", "ms_per_step"],
         reproduce="bash ops/device/bench.sh sweep"),
    dict(id="shared-document", title="Shared document: many questions over one document",
         what="64 questions over one shared 124928-token document decoded as one batch (full: cascade "
              "attention over one copy of its KV), beside the peer's `--shared-prefix --graph` cascade.",
         rows=lambda r: r.get("mode") == "decode",
         cols=["kv_policy", "context", "batch", "question", "suffix", "hit_rate", "tokens_per_s", "ms_per_step"],
         reproduce="bash ops/device/bench.sh shared"),
    dict(id="ttft", title="Time to first token: cold and cached in memory",
         what="Time to first token of a 64-token question about a 124928-token document, cold (`--cache off`) "
              "and with the document cached in memory (`--cache hbm`; ShadowKV with the dense and the sparse "
              "continuation, `ttft_tier0_ms` once the document's values are in tier 0), beside the peer's prefill.",
         rows=lambda r: r.get("mode") in ("ttft", "prefill"),
         cols=["kv_policy", "cache", "continuation", "context", "question", "cached_prompt_tokens", "ttft_ms",
               "ttft_tier0_ms", "seconds"],
         reproduce="bash ops/device/bench.sh ttft"),
    dict(id="ttft-disk", title="TTFT from disk",
         what="Time to first token with the document cached only on disk (read back after the memory cache "
              "is cleared), beside the disk's raw direct-I/O bandwidth (`dd`).",
         rows=lambda r: True,
         cols=["kv_policy", "value_format", "cache", "continuation", "ttft_ms", "import_ms", "lazy_value_bytes",
               "restore_gb_per_s", "read_gb_per_s", "write_gb_per_s"],
         reproduce="TTFT_DISK_FULL=0 bash ops/device/bench.sh ttft_disk; "
                   "TTFT_DISK_FULL=0 TTFT_DISK_ARGS='--value-format fp8' bash ops/device/bench.sh ttft_disk"),
    dict(id="tier0", title="Tier 0",
         what="ShadowKV's shared decode (64 x 124928) with the document's values copied to spare device memory "
              "(tier 0 on) and left in host memory (off), between peer `--shared-prefix` runs; then the TTFT "
              "of a question about a document in tier 0.",
         rows=lambda r: True,
         cols=["tier0", "context", "batch", "force_hit_rate", "hit_rate", "tokens_per_s", "ms_per_step", "ttft_ms",
               "ttft_tier0_ms"],
         reproduce="bash ops/device/bench.sh tier0"),
    dict(id="service", title="The service through its API",
         what="The service on the GPU (coordinator + one worker) measured by penumbra-service-bench: TTFT of a "
              "question about a put 124864-token document, 14 questions decoding together, beside "
              "`penumbra-bench` at the same shape and the peer.",
         rows=lambda r: True,
         cols=["kv_policy", "context", "batch", "tokens_per_s", "ms_per_step", "ttft_client_s",
               "ttft_worker_s", "document_put_s", "max_token_gap_s"],
         reproduce="bash ops/device/bench.sh service  # SERVICE_POLICY=full for the full policy"),
    dict(id="mixed-documents", title="Mixed documents: a policy per document",
         what="The mixed-documents workload through the service (penumbra-service-bench --mixed-hot): 4 hot "
              "documents asked K times each and 2 asked once, all of 124928 tokens (Llama-3.1-8B shape, random "
              "weights), one document every 5 s, a hot one's questions every 2 s (or 0.5 s) from its put, each "
              "question's answer 128 (or 512) tokens; one fresh worker (60000 MB of device memory for the "
              "document cache) per policy: auto (full or ShadowKV per document, auto_exact_mib for the exact "
              "ones), full, shadowkv. tokens/s over the whole run, TTFT as the client sees it.",
         rows=lambda r: True,
         cols=["policy", "questions_per_hot_document", "max_new_tokens", "question_interval_s", "auto_exact_mib",
               "tokens_per_s", "wall_s", "ttft_p50_s", "ttft_p99_s", "put_p50_s", "questions", "failed"],
         reproduce="bash ops/device/bench.sh mixed; MIXED_QUESTIONS=16 MIXED_NEW=512 MIXED_Q_S=0.5 "
                   "bash ops/device/bench.sh mixed"),
    dict(id="jobs", title="Batch jobs",
         what="8 documents of 32768 tokens x 16 questions: one batch job beside the same questions one at a "
              "time, and the peer's shared-prefix decode at 16 x 32768.",
         rows=lambda r: True,
         cols=["kv_policy", "context", "batch", "tokens_per_s", "job_tokens_per_s", "job_wall_s",
               "one_at_a_time_tokens_per_s", "one_at_a_time_wall_s", "answers_equal", "items"],
         reproduce="bash ops/device/bench.sh jobs"),
    dict(id="data-parallel", title="Data parallel: two workers on two GPUs",
         what="One worker per GPU behind one coordinator: 16 questions about one 32768-token document (one "
              "worker), then about each of two (both workers).",
         rows=lambda r: True,
         cols=["kv_policy", "context", "batch", "workers", "one_worker_tokens_per_s", "tokens_per_s", "speedup"],
         reproduce="bash ops/device/bench.sh dp  # kind nvidia-h100-x2"),
    dict(id="context-parallel", title="Context parallel: one sequence across two GPUs",
         what="One ShadowKV sequence decoding across two GPUs (penumbra-bench cp-decode, one rank per GPU), "
              "beside the peer on one GPU of the same machine.",
         rows=lambda r: r.get("mode") == "cp-decode" or (peer_decode(r) and r.get("suite") == "cp"),
         cols=["kv_policy", "shard_selection", "gpus", "context", "batch", "tokens_per_s", "ms_per_step"],
         reproduce="CP_SINGLE= CP_CONTEXTS=2097152 bash ops/device/bench.sh cp  # kind nvidia-h100-x2"),
    dict(id="context-parallel-4gpu", title="Context parallel: one sequence across four GPUs",
         what="One ShadowKV sequence decoding across four GPUs (penumbra-bench cp-decode, one rank per GPU, "
              "the shards synthesized rather than prefilled).",
         rows=lambda r: r.get("mode") == "cp-decode" and r.get("gpus") == 4,
         cols=["kv_policy", "shard_selection", "gpus", "context", "shard_tokens", "batch", "tokens_per_s",
               "ms_per_step", "setup_s"],
         reproduce="CP_TEST=0 CP_PEER=0 CP_SINGLE= CP_GPUS=4 CP_CONTEXTS=4194304 bash ops/device/bench.sh cp  "
                   "# kind nvidia-h100-x4"),
    dict(id="context-parallel-prefill", title="Context parallel: prefill across two GPUs",
         what="Prefill of one prompt (full attention) on one GPU and across two (penumbra-bench prefill, one rank "
              "per GPU), balanced (rank r hands the attention of its second half of rows over earlier shards to "
              "those ranks; the default) and unbalanced (--cp-prefill-balance off).",
         rows=lambda r: r.get("mode") == "prefill" and r.get("suite") == "cp",
         cols=["kv_policy", "gpus", "context", "cp_prefill_balance", "prefill_chunk", "seconds"],
         reproduce="CP_TEST=0 CP_PEER=0 CP_SINGLE= CP_CONTEXTS= CP_PREFILL=262144 bash ops/device/bench.sh cp  "
                   "# kind nvidia-h100-x2"),
    dict(id="service-context-group", title="A context group inside the service",
         what="Two penumbra-worker ranks (one per GPU) formed into a group by the coordinator: a document put "
              "through the API and B questions about it decoding together (service-cp-decode), beside "
              "penumbra-bench cp-decode at the same shape (B sequences) in the same call, and the peer on one GPU.",
         rows=lambda r: r.get("suite") == "service_cp",
         cols=["kv_policy", "gpus", "context", "batch", "tokens_per_s", "ms_per_step", "ttft_client_s",
               "document_put_s"],
         reproduce="SCP_CONTEXT=262144 SCP_BATCH=4 bash ops/device/bench.sh service_cp  # kind nvidia-h100-x2"),
    dict(id="openai-vs-thrift", title="The OpenAI-compatible API beside the Thrift API",
         what="One service (penumbra-worker with the 8B shape, random weights, ShadowKV; penumbra-coordinator "
              "over TLS), one put document of 32768 tokens, 16 clients asking 64-token questions about it (128 "
              "tokens each, streamed) through ops/loadtest.py --api both: phases Thrift, OpenAI, Thrift, OpenAI, "
              "then the comparison (tokens/s of each API the mean of its phases, TTFT percentiles over both "
              "phases' requests); the peer's shared-prefix decode at the same shape first.",
         rows=lambda r: r.get("suite") == "openai_load",
         cols=["api", "clients", "batch", "context", "requests", "tokens_per_s", "ttft_p50_s",
               "ttft_p99_s", "token_latency_p50_s", "tokens_per_s_ratio", "ttft_p50_ratio", "ttft_p99_ratio",
               "errors"],
         reproduce="LOAD_SECONDS=60 bash ops/device/bench.sh openai_load"),
    dict(id="context-group-faults", title="A context group's rank lost mid-decode",
         what="A cp-decode pair with rank 1 SIGKILLed, then SIGSTOPped, while both decode: the seconds until "
              "rank 0 ends with an error (never a hang; the group's timeout 20 s).",
         rows=lambda r: r.get("bench") == "cp-rank-lost",
         cols=["signal", "context", "seconds", "timeout_s"],
         reproduce="bash ops/device/bench.sh cp_kill  # kind nvidia-h100-x2"),
    dict(id="store-node", title="Value-store nodes",
         what="A value-store node (`penumbra-store`) read over UCX on loopback, 16 KiB blocks in random order "
              "(store-node-read: 64 blocks per message, replies into the reader's buffers), plaintext and sealed, "
              "beside gathering the same blocks from DRAM and from the local store.",
         rows=lambda r: True,
         cols=["bench", "sealed", "threads", "connections", "node_workers", "blocks_per_message", "gb_per_s",
               "node_blocks_gb_per_s", "node_batched_gb_per_s", "node_whole_gb_per_s", "dram_gather_gb_per_s",
               "local_blocks_gb_per_s", "local_gb_per_s", "put_gb_per_s"],
         reproduce="bash ops/device/bench.sh store_node  # on the GPU machine"),
    dict(id="attention-kernels", title="Attention kernels", group="bench",
         what="The attention kernels alone (`PENUMBRA_KERNEL_BENCH=1` GPU tests): the newest measurement of "
              "each kernel.",
         rows=lambda r: str(r.get("bench", "")).endswith("-kernel"),
         cols=["path", "variant", "head_dim", "hq", "hkv", "nq", "batch", "keys", "ms_per_layer", "old_ms", "new_ms",
               "tflop_per_s", "gb_per_s"],
         reproduce="bash .device/run attention_gpu_test --gtest_filter=AttentionGpuTest.Bench  # PENUMBRA_KERNEL_BENCH=1"),
    dict(id="value-fetch-fp8", title="The value fetch: bf16 rows beside fp8 rows",
         what="ShadowKV's value fetch alone (value_fp8_gpu_test, `PENUMBRA_KERNEL_BENCH=1`): the missed chunks of a "
              "decode step's layer (14 sequences x 8 KV heads x 256 chunks of 8 x 128) read from pinned host "
              "memory in place into V slots, as bf16 rows and as fp8 rows dequantized on the way "
              "(kernels/value_format.h), two rounds; the engine does not store fp8 values yet.",
         rows=lambda r: r.get("bench") == "value-fetch",
         cols=["value_format", "round", "batch", "hkv", "misses_per_head", "chunk_tokens", "d", "ms",
               "link_gb_per_s", "chunks_per_ms"],
         reproduce="PENUMBRA_KERNEL_BENCH=1 bash .device/run value_fp8_gpu_test --gtest_filter='*Bench*'"),
    dict(id="value-format-decode", title="ShadowKV decode with fp8 values beside bf16 values",
         what="ShadowKV decode at 124928 tokens (the defaults, the largest batch that fits: `--batch` unset) with "
              "the values stored as bf16 and as fp8 (`--value-format`), natural and forced-60% hit rates, the two "
              "formats alternating twice between peer runs (`--graph`) of the same call.",
         rows=lambda r: peer_decode(r) or (engine(r, "decode", "shadowkv") and "value_format" in r),
         cols=["value_format", "context", "batch", "force_hit_rate", "hit_rate", "tokens_per_s", "ms_per_step"],
         reproduce="VARIANTS='--value-format bf16|--value-format fp8' VARIANT_ROUNDS=2 VARIANT_STEPS=50 "
                   "bash ops/device/bench.sh variants"),
    dict(id="value-format-decode-s1", title="fp8 values beside bf16 values with one landmark per chunk",
         what="The same comparison with the paper's one landmark per chunk (`--landmarks-per-chunk 1`), whose "
              "GPU state per token is 0.59x the default's: with fp8 values the batch is then set by host memory "
              "rather than the GPU's.",
         rows=lambda r: peer_decode(r) or (engine(r, "decode", "shadowkv") and "value_format" in r),
         cols=["value_format", "landmarks_per_chunk", "context", "batch", "force_hit_rate", "hit_rate",
               "tokens_per_s", "ms_per_step"],
         reproduce="VARIANTS='--landmarks-per-chunk 1 --value-format bf16|--landmarks-per-chunk 1 --value-format fp8' "
                   "VARIANT_ROUNDS=2 bash ops/device/bench.sh variants"),
    dict(id="value-format-accuracy", title="Accuracy with fp8 values",
         what="Held-out accuracy (task sets from a seed and the KJV haystack, 25 records per task) of ShadowKV "
              "with bf16 values (a) and fp8 values (b), paired by ops/evalmodel/compare_predictions.py.",
         rows=lambda r: True,
         cols=["comparison", "records_per_task", "length", "n", "accuracy_a", "accuracy_b", "gap_points",
               "right_only_a", "right_only_b"],
         reproduce="CONFIGS='shadowkv|shadowkv --value-format fp8' TASKS='--lengths 16384 --num 25 --seed 5151' "
                   "bash ops/evalmodel/ablation.sh  # and --lengths 32768"),
    dict(id="continuation-accuracy", title="Continuations: accuracy on the GPU",
         what="Held-out accuracy (task sets from a seed and the KJV haystack, 25 records per task) of a question "
              "continuing a factored document (`penumbra eval --segmented`): ShadowKV's dense continuation or full "
              "attention (a) against the sparse continuation (b), paired by ops/evalmodel/compare_predictions.py.",
         rows=lambda r: True,
         cols=["comparison", "length", "n", "accuracy_a", "accuracy_b", "gap_points", "se_points", "right_only_a",
               "right_only_b"],
         reproduce="CONFIGS='full --segmented|shadowkv --segmented --continuation dense|shadowkv --segmented "
                   "--continuation sparse' TASKS='--lengths 16384 --num 25 --seed 5151' bash ops/evalmodel/ablation.sh"
                   "  # and --lengths 32768"),
    dict(id="skinny-linear", title="Skinny linear kernel",
         what="The few-row linear kernel against cuBLAS at the model's projection shapes.",
         rows=lambda r: r.get("bench") == "skinny_linear",
         cols=["shape", "out", "in", "n", "skinny_ms", "skinny_gbps", "cublas_ms", "cublas_gbps", "speedup"],
         reproduce="PENUMBRA_KERNEL_BENCH=1 bash .device/run linear_skinny_gpu_test"),
    dict(id="eval-accuracy", title="Evaluation accuracy",
         what="Accuracy of full attention and ShadowKV on the evaluation tasks (paired comparisons by "
              "ops/evalmodel/compare_predictions.py; accuracies and gaps in points).",
         rows=lambda r: True,
         cols=["comparison", "records_per_task", "length", "n", "accuracy_a", "accuracy_b", "gap_points",
               "se_points"],
         reproduce="bash ops/device/bench.sh eval  # the 64K runs: docs/evalmodel.md"),
    dict(id="eval-segmented-cpu", title="Segmented continuations: accuracy on the CPU",
         what="Accuracy of ShadowKV's continuations (dense, sparse) beside full attention, on this machine's CPU.",
         rows=lambda r: r.get("summary") is True,
         cols=["run", "kv_policy", "continuation", "length", "records", "turns", "accuracy", "partial", "hit_rate",
               "seconds"],
         reproduce="penumbra eval --model models/penumbra-eval --segmented ...  # the row's command"),
    dict(id="spindlekv-eval-cpu", title="SpindleKV: what it keeps against accuracy (CPU)",
         what="Accuracy of spindlekv at reserve ratios 0.1-0.4 and pooling 7 and 31, with its codebooks and without "
              "them (thresholds 2: eviction only, the pyramid with each query head's own tokens), beside full "
              "attention and ShadowKV, on 40 records of 2048 tokens (the question last, in the observation window; "
              "segmented: the document compressed at its own end); kv_bytes_ratio is the compressed state's bytes "
              "over the exact f32 cache's, references and codebooks included.",
         rows=lambda r: r.get("summary") is True,
         cols=["run", "kv_policy", "reserve_ratio", "pool", "key_threshold", "value_threshold", "segmented",
               "kv_bytes_ratio", "budget_fraction", "accuracy", "seconds"],
         reproduce="penumbra eval --model models/penumbra-eval --device cpu --kv-policy spindlekv ...  # the row's command"),
    dict(id="specontext-eval-cpu", title="SpeContext: accuracy against its budget (CPU)",
         what="Accuracy of specontext with the evaluation model's distilled retrieval head at budgets of 256 to "
              "1024 of 2048 tokens (the defaults otherwise: local 128, successors 16; the paper's shape: local 32, "
              "no successors; an observation window of the prompt's last 64 queries), beside full attention in the "
              "same runs, on the 40 records of 2048 tokens of the SpindleKV rows (ShadowKV at a 12.5% budget: "
              "74.5% there); hit_rate is the share of a step's selected tokens the step before had selected.",
         rows=lambda r: r.get("summary") is True,
         cols=["run", "kv_policy", "specontext_budget", "specontext_local", "specontext_successors",
               "specontext_observe", "accuracy", "hit_rate", "seconds"],
         reproduce="penumbra eval --model models/penumbra-eval --device cpu --kv-policy specontext ...  # the row's command"),
    dict(id="spindlekv-decode", title="SpindleKV decode beside the peer",
         what="SpindleKV (`--kv-policy spindlekv`, its state in device memory) decoding at 124928 tokens at the "
              "largest batch that fits, beside the peer (`--graph`) first and last in the same call: reserve ratio "
              "0.1 and 0.3 with new tokens searching the codebook's last 1024 entries (`merge_window`), and 0.1 "
              "with the paper's search of the whole codebook (`merge_window` 0). Random weights and random keys "
              "and values through the real compression: random keys share no codebook entry and the 4 query heads "
              "of a KV head choose nearly disjoint tokens, so a KV head holds about 1 - (1 - r)^4 of the context; "
              "a trained model's heads agree more and share entries (the eval rows' kv_bytes_ratio).",
         rows=lambda r: peer_decode(r) or engine(r, "decode", "spindlekv"),
         cols=["reserve_ratio", "pool", "merge_window", "context", "batch", "batch_limit", "tokens_per_s",
               "ms_per_step"],
         reproduce="bash ops/device/bench.sh spindlekv"),
    dict(id="spindlekv-eval", title="SpindleKV accuracy on the GPU beside full attention and ShadowKV",
         what="The first evaluation model at 16384 and 32768 tokens (25 records per task, the KJV haystack, seed "
              "5151), on an H200: full attention, ShadowKV (defaults) and spindlekv at reserve ratios 0.1 and 0.2 "
              "with pooling 7 (SnapKV's), 31 and 63, and at 0.1 without codebooks (thresholds 1.5: eviction "
              "only). kv_bytes_ratio: the compressed state's bytes over the exact cache's (bf16) for the same "
              "tokens, references and codebooks included.",
         rows=lambda r: r.get("summary") is True,
         cols=["length", "run", "kv_policy", "reserve_ratio", "pool", "kv_bytes_ratio", "accuracy", "seconds"],
         reproduce="penumbra eval --model models/penumbra-eval --tasks TASKS --device cuda --json ...  # the row's "
                   "command; TASKS from the row's tasks_made_by"),
    dict(id="service-load-cpu", title="Load test on the CPU",
         what="A bounded load test on loopback, `models/penumbra-eval` on 2 CPU cores.",
         rows=lambda r: True,
         cols=["clients", "seconds", "requests", "requests_per_s", "tokens_per_s", "ttft_p50_s", "ttft_p99_s",
               "token_latency_p50_s", "token_latency_p99_s", "errors"],
         reproduce="python3 ops/loadtest.py --start models/penumbra-eval --clients 16 --seconds 30 --max-new-tokens 32"),
    dict(id="fairness-cpu", title="Tenants: a flooding tenant and a steady one (CPU)",
         what="16 flooding clients against 1 steady client: the steady client's TTFT loaded over unloaded.",
         rows=lambda r: True,
         cols=["flood_clients", "steady_clients", "max_batch", "share_window_ms", "ttft_p50_ratio", "ttft_p99_ratio",
               "stuck_clients"],
         reproduce="python3 ops/fairness.py --start models/penumbra-eval --seconds 40 --flood-clients 16 --max-batch 8"),
    dict(id="tls-overhead-cpu", title="TLS overhead on the CPU",
         what="Decode through the service with TLS on and off, in alternating pairs (summaries of each run).",
         rows=lambda r: str(r.get("bench", "")).endswith("-summary"),
         cols=["pairs", "quiet_pairs", "off_tokens_per_s", "on_tokens_per_s", "on_off_ratio", "off_ttft_client_s",
               "on_ttft_client_s", "within_2_percent"],
         reproduce="the row's command (ops/tls_overhead.py)"),
]


def load_manifest(path=MANIFEST):
    with open(path) as f:
        return json.load(f)


def rows_of(name):
    return [r for _, r in record.read_rows(os.path.join(RESULTS, name))]


def derived(name):
    """The manifest fields of a rows file that follow from its rows."""
    rows = rows_of(name)
    return {"rows": len(rows),
            "suites": sorted({r["suite"] for r in rows}),
            "device": sorted({r["device"] for r in rows}),
            "device_count": max(r["device_count"] for r in rows),
            "commits": sorted({r["commit"] for r in rows}),
            "dates": sorted({r["date"][:10] for r in rows})}


def newest_first(entries):
    return sorted(entries, key=lambda e: (max(e["dates"]), e.get("recorded", 0), e["path"]), reverse=True)


# Labels of the device call that made a row ("session15-call1 (...)"): the
# record keeps them, the page (the system as it is) shows only what follows.
RUN_LABEL = re.compile(r"^session\d+(-call\d+)?\s*")


def cell(v):
    if v is None:
        return ""
    s = v if isinstance(v, str) else json.dumps(v)
    if isinstance(v, str) and RUN_LABEL.match(s):
        s = RUN_LABEL.sub("", s)
        if s.startswith("(") and s.endswith(")"):
            s = s[1:-1]
    return s.replace("|", "\\|").replace("\n", " ")


def who(r):
    if is_peer(r):
        return "peer " + r["peer"]
    if r.get("kv_policy") and r.get("bench") in ("decode", "prefill", "ttft", "shared", "cp-decode"):
        return "penumbra " + r["bench"] + " " + r["kv_policy"]
    return r.get("bench", "")


def short(c):
    return c[:10]


def table(rows, cols):
    used = [c for c in cols if any(c in r for r in rows)]
    multi = len({r["commit"] for r in rows}) > 1
    head = ["who"] + used + (["commit"] if multi else [])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        line = [cell(who(r))] + [cell(r.get(c)) for c in used] + ([short(r["commit"])] if multi else [])
        out.append("| " + " | ".join(line) + " |")
    return out


def units_line(rows, cols):
    units = {}
    for r in rows:
        for k, u in r.get("units", {}).items():
            if k in cols:
                units.setdefault(k, u)
    return ", ".join(f"{k}: {units[k]}" for k in cols if k in units)


def section(cap, entries):
    cands = newest_first([e for e in entries if e["kind"] == "rows" and cap["id"] in e.get("backs", [])])
    picks = []  # (entry, rows)
    if cap.get("group"):
        seen = set()
        for e in cands:
            rows = [r for r in rows_of(e["path"]) if cap["rows"](r)]
            groups = {r.get(cap["group"]) for r in rows if not is_peer(r)}
            if cap.get("need_peer"):  # only where the same file (call) has the peer at that value
                groups &= {r.get(cap["group"]) for r in rows if is_peer(r)}
            groups -= seen
            if groups:
                picks.append((e, [r for r in rows if r.get(cap["group"]) in groups]))
                seen |= groups
    else:
        for e in cands:
            rows = [r for r in rows_of(e["path"]) if cap["rows"](r)]
            if rows:
                picks.append((e, rows))
                break
    out = [f"## {cap['title']}", "", cap["what"], ""]
    if not picks:
        return out + ["No rows in the record yet.", ""]
    for e, rows in picks:
        devices = sorted({f"{r['device']}" + (f" x{r['device_count']}" if r["device_count"] > 1 else "") for r in rows})
        dates = sorted({r["date"][:10] for r in rows})
        commits = sorted({short(r["commit"]) for r in rows})
        out += [f"- **Record**: `bench/results/{e['path']}` ({e['what']})",
                f"- **Device**: {', '.join(devices)}; **date**: {', '.join(dates)}; **commit**: {', '.join(commits)}",
                f"- **Reproduce**: `{cap['reproduce']}`", ""]
        out += table(rows, cap["cols"])
        u = units_line(rows, cap["cols"])
        out += ["", f"Units: {u}." if u else "", ""]
        cmds = []
        for r in rows:
            c = r["command"] + (" (reconstructed)" if r.get("command_reconstructed") else "")
            if c not in cmds:
                cmds.append(c)
        out += ["<details><summary>Commands of these rows</summary>", ""]
        out += [f"    {c}" for c in cmds]
        out += ["", "</details>", ""]
    return out


def index(entries):
    out = ["## Every file of the record", "",
           "From `bench/results/MANIFEST.json`, newest first. *backs*: the sections above that a file feeds.", "",
           "| file | kind | what | suites | device | dates | commits | backs |", "|---|---|---|---|---|---|---|---|"]
    for e in newest_first(entries):
        out.append("| " + " | ".join([
            f"`{e['path']}`", e["kind"], cell(e.get("what", "")), ", ".join(e.get("suites", [])),
            ", ".join(e.get("device", [])), ", ".join(e["dates"]), ", ".join(short(c) for c in e.get("commits", [])),
            ", ".join(e.get("backs", []))]) + " |")
    return out + [""]


def render(manifest=None, header_path=HEADER):
    m = manifest or load_manifest()
    entries = m["files"]
    with open(header_path) as f:
        header = f.read().rstrip("\n")
    out = [header, ""]
    out += ["## Contents", ""] + [f"- [{c['title']}](#{anchor(c['title'])})" for c in CAPABILITIES]
    out += [f"- [Every file of the record](#{anchor('Every file of the record')})", ""]
    for cap in CAPABILITIES:
        out += section(cap, entries)
    out += index(entries)
    text = "\n".join(out)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.rstrip("\n") + "\n"


def anchor(title):
    """GitHub's anchor of a heading."""
    a = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return a.replace(" ", "-")


def update_manifest(path=MANIFEST):
    """Refreshes the derived fields of every rows file and lists files the manifest
    lacks (backs and what left empty: fill them in)."""
    m = load_manifest(path)
    by_path = {e["path"]: e for e in m["files"]}
    for name in sorted(os.listdir(RESULTS)):
        full = os.path.join(RESULTS, name)
        if name == "archive" or name == "MANIFEST.json":
            continue
        key = name + "/" if os.path.isdir(full) else name
        if key not in by_path and (name.endswith(".jsonl") or os.path.isdir(full)):
            e = {"path": key, "kind": "raw" if os.path.isdir(full) else "rows", "backs": [], "what": "",
                 "recorded": int(time.time()), "dates": [name[:10]]}
            m["files"].append(e)
            by_path[key] = e
            print(f"MANIFEST.json: added {key}: fill in its 'backs' and 'what'", file=sys.stderr)
        e = by_path[key]
        if e["kind"] == "rows":
            e.update(derived(name))
    with open(path, "w") as f:
        json.dump(m, f, indent=1)
        f.write("\n")


def main(argv=None):
    p = argparse.ArgumentParser(description="Write docs/benchmarks.md from bench/results.")
    p.add_argument("--out", default=DOC, help="default: docs/benchmarks.md")
    p.add_argument("--update-manifest", action="store_true",
                   help="first refresh bench/results/MANIFEST.json from the files")
    a = p.parse_args(argv)
    if a.update_manifest:
        update_manifest()
    text = render()
    with open(a.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
