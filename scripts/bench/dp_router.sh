#!/usr/bin/env bash
# Data-parallel routing on one GPU: two replicas of MODEL share it (-dp 2
# --gpu-memory-utilization 0.45 each, KV caches capped at DP_BLOCKS blocks each), driven by
# `tessera bench serve` with a shared-prefix workload (DP_PREFIXES system prompts of 1,000
# tokens, each followed by DP_PROMPTS / DP_PREFIXES users' 50-token questions (8), 128 output
# tokens, Poisson arrivals at each of DP_RATES), once with --router prefix and once with --router round_robin; then one
# replica holding the whole cache (2 x DP_BLOCKS) for the prefix-cache hit-rate baseline.
# Goodput: requests/s with TTFT <= 500 ms and TPOT <= 50 ms.
#   scripts/bench/dp_router.sh BIN_DIR MODEL_DIR OUT_DIR
# Writes OUT_DIR/dp_<policy>_r<rate>.json (bench serve's) and OUT_DIR/dp_router.json (the
# comparison, with the machine, commit and commands).
set -uo pipefail
bin=$1 model=$2 out=$3
rates=${DP_RATES:-8,16,32}
prefixes=${DP_PREFIXES:-64}
blocks=${DP_BLOCKS:-4000}
prompts=${DP_PROMPTS:-$((prefixes * 8))}  # users per prefix: prompts / prefixes
port=${DP_PORT:-8131}
mkdir -p "$out"
url=http://127.0.0.1:$port

serve() {  # serve NAME FLAGS...: a server in the background, ready; its log OUT/serve_NAME.log
  local name=$1; shift
  "$bin/tessera" serve "$model" --port "$port" --max-model-len 4096 "$@" \
    > "$out/serve_$name.log" 2>&1 &
  server=$!
  for _ in $(seq 1 900); do
    curl -sf "$url/health" > /dev/null && return 0
    kill -0 $server 2>/dev/null || { tail -30 "$out/serve_$name.log"; return 1; }
    sleep 0.5
  done
  return 1
}

stop() { kill -INT $server; wait $server; }

drive() {  # drive NAME RATE: one bench serve run (its JSON has the server's cache hit rate)
  local name=$1 rate=$2
  "$bin/tessera" bench serve --base-url "$url" --dataset-name prefix_repetition \
    --prefix-repetition-prefix-len 1000 --prefix-repetition-suffix-len 50 \
    --prefix-repetition-num-prefixes "$prefixes" --prefix-repetition-output-len 128 \
    --num-prompts "$prompts" --request-rate "$rate" --ignore-eos --seed 1 \
    --goodput ttft:500 tpot:50 --output-json "$out/dp_${name}_r${rate}.json"
}

IFS=, read -ra rate_list <<< "$rates"
for policy in prefix round_robin; do
  serve "$policy" -dp 2 --router "$policy" --gpu-memory-utilization 0.45 \
    --num-gpu-blocks-override "$blocks" || exit 1
  for r in "${rate_list[@]}"; do drive "$policy" "$r" || { stop; exit 1; }; done
  curl -sf "$url/metrics" | grep '^tessera:replica_\|^tessera:router' > "$out/metrics_$policy.txt"
  stop
done
serve single --gpu-memory-utilization 0.9 --num-gpu-blocks-override $((2 * blocks)) || exit 1
drive single "${rate_list[0]}" || { stop; exit 1; }
stop

python3 - "$out" "$rates" "$prefixes" "$blocks" "$prompts" <<'PY'
import json, os, platform, subprocess, sys
out, rates = sys.argv[1], sys.argv[2].split(",")
prefixes, blocks, prompts = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def load(name, r):
    return json.load(open(os.path.join(out, f"dp_{name}_r{r}.json")))
rows = []
for r in rates:
    p, rr = load("prefix", r), load("round_robin", r)
    rows.append({
        "request_rate": float(r),
        "goodput_prefix": p["goodput"], "goodput_round_robin": rr["goodput"],
        "goodput_ratio": p["goodput"] / rr["goodput"] if rr["goodput"] > 0 else None,
        "hit_rate_prefix": p["prefix_cache_hit_rate"],
        "hit_rate_round_robin": rr["prefix_cache_hit_rate"],
        "ttft_p99_ms": {"prefix": p["ttft_ms"]["p99"], "round_robin": rr["ttft_ms"]["p99"]},
        "tpot_p99_ms": {"prefix": p["tpot_ms"]["p99"], "round_robin": rr["tpot_ms"]["p99"]},
        "commands": [p["command"], rr["command"]],
    })
single = load("single", rates[0])
first = rows[0]
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except OSError:
    gpu = ""
summary = {
    "machine": {"host": platform.node(), "gpu": gpu},
    "commit": os.environ.get("TESSERA_COMMIT", ""),
    "workload": {"prefixes": prefixes, "prefix_len": 1000, "requests": prompts,
                 "suffix_len": 50, "output_len": 128, "arrivals": "poisson",
                 "kv_blocks_per_replica": blocks, "slo_ms": {"ttft": 500, "tpot": 50}},
    "rates": rows,
    "best_goodput_ratio": max((x["goodput_ratio"] or 0) for x in rows),
    "single_replica_whole_cache": {"request_rate": float(rates[0]),
                                   "hit_rate": single["prefix_cache_hit_rate"],
                                   "goodput": single["goodput"], "command": single["command"]},
    "hit_rate_ratio_prefix_vs_single": (first["hit_rate_prefix"] / single["prefix_cache_hit_rate"]
                                        if single["prefix_cache_hit_rate"] else None),
}
json.dump(summary, open(os.path.join(out, "dp_router.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
