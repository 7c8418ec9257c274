#!/usr/bin/env bash
# Hierarchical against flat collectives across hosts (Note [Hierarchical collectives]) and the
# ZeRO++ options: data parallel ZeRO (STAGE 2, the default, or 3) on the d768 GPT (86M
# parameters, fp32) over 2 hosts x 2 ranks, hosts being network namespaces of scripts/multihost
# joined by a link shaped to RATE (default 1gbit). For each mode, two runs (S1 and S2 steps) give
# the bytes each host sent on its link per step (the difference over S2 - S1 steps, so start-up
# traffic cancels), beside the formula, with P the parameters' fp32 bytes (= the gradients'),
# f = (H-1)/H, L ranks per host, q = (1 + 4/2048) / 4 (int8 blocks of 2048 with an fp32 scale),
# g = (1/2 + 4/128) / 4 (4-bit blocks of 128 with an fp32 scale):
#   ZeRO-2 (a reduce-scatter of the gradients, an all-gather of the updated parameters)
#     flat  L f (P + P)      hier  f (P + P)      qgz  f (g P + P)
#   ZeRO-3 (each layer gathered for forward and again for backward, gradients reduce-scattered)
#     flat  L f (2P + P)     hier  f (2P + P)     qgz  f (2P + g P)
#     hpz   f (P + P)        (zero_hpz_partition_size 2: backward gathers within the host)
#     qwz   f (2 q P + P)    (zero_quantized_weights: int8 all-gathers)
#     zeropp f (q P + g P)   (hpZ + qwZ + qgZ: ZeRO++)
# and the median step time of the longer run. Prints the ratios side by side. MODES picks modes
# (default: every mode of the stage). Persistent small units (layer norms) are left out of the
# formula: under 0.1% of the bytes.
#
# The step time gains what the link costs: 4 ranks share this machine's cores, so the longer the
# samples (SEQ, default 128), the more the step is compute and the less the link matters.
#
# Usage: [STAGE=3] [SEQ=32] [MODES="hier hpz"] [BUCKET=50000000] benchmarks/multihost_zero.sh [CLI] [RATE]
#        (as root; exit 77 without namespaces)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cli="${1:-$root/build/bin/torchspeed}"
rate="${2:-1gbit}"
S1="${S1:-2}" S2="${S2:-5}" SEQ="${SEQ:-128}" STAGE="${STAGE:-2}"  # SEQ: tokens per sample (the compute per step)
# reduce_bucket_size (and allgather_bucket_size; stage 3's buckets are its layers). Smaller buckets
# start reducing earlier in backward. ZeRO-2 at 10M elements (8 buckets): hierarchical 1.68x and
# 1.69x faster than flat in two runs, each step within 2% of its run's median; at 50M (2 buckets,
# the first reduced only after backward) 1.65x and 1.41x, the runs 0.5 s apart.
BUCKET="${BUCKET:-10000000}"
case "$STAGE" in
  2) MODES="${MODES:-flat hier qgz}" ;;
  3) MODES="${MODES:-flat hier qgz hpz qwz zeropp}" ;;
  *) echo "multihost_zero.sh: STAGE must be 2 or 3, not '$STAGE'" >&2; exit 2 ;;
esac
work="$(mktemp -d /tmp/ts-multihost-zero.XXXXXX)"
trap 'rm -rf "$work"' EXIT
cat >"$work/cfg.json" <<JSON
{
  "train_batch_size": 4,
  "train_micro_batch_size_per_gpu": 1,
  "seed": 1234,
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
  "zero_optimization": {"stage": $STAGE, "reduce_bucket_size": $BUCKET, "allgather_bucket_size": $BUCKET, "overlap_comm": true},
  "model": {"vocab": 256, "seq_len": $SEQ, "d_model": 768, "n_layer": 12, "n_head": 12, "dropout": 0.0},
  "train": {"eval_interval": 1000, "log_interval": 1, "checkpoint_interval": 0}
}
JSON
cat >"$work/runs.sh" <<INNER
set -euo pipefail
sent() {  # bytes each host has sent on its link so far, "host bytes" lines
  for link in \$TS_MH_LINKS; do
    echo "\${link%%:*} \$(ip netns exec "\${link%%:*}" cat /sys/class/net/\${link#*:}/statistics/tx_bytes)"
  done
}
# Two TCP connections per pair of ranks for every mode: one flow did not fill the link (340 MB
# staged in 5 collectives took 1.61-1.91 s with one connection per pair, 1.45-1.48 s with 2 or 4,
# where the link alone needs 1.36 s; flat 2.86-3.11 s either way).
export OMPI_MCA_btl_tcp_links=\${OMPI_MCA_btl_tcp_links:-2}
for mode in $MODES; do
  for steps in $S1 $S2; do
    sent >"$work/\$mode-\$steps.before"
    TORCHSPEED_COMM_HIERARCHICAL=\$([ \$mode = flat ] && echo 0 || echo 1) \
      "$cli" launch --hostfile "\$TS_MH_HOSTFILE" -- "$cli" train -c "$work/cfg.json" --out "$work/\$mode-\$steps" \
      --set train.steps=\$steps \
      --set zero_optimization.zero_quantized_gradients=\$(case \$mode in (qgz|zeropp) echo true;; *) echo false;; esac) \
      --set zero_optimization.zero_hpz_partition_size=\$(case \$mode in (hpz|zeropp) echo 2;; *) echo 1;; esac) \
      --set zero_optimization.zero_quantized_weights=\$(case \$mode in (qwz|zeropp) echo true;; *) echo false;; esac) \
      >"$work/\$mode-\$steps.log" 2>&1 || { cat "$work/\$mode-\$steps.log"; exit 1; }
    sent >"$work/\$mode-\$steps.after"
    # Each run ends by saving its checkpoint and model (1.3 GB for ZeRO-2): written back to disk
    # while the next run trained, that slowed the next run's steps by up to 1.5 s. Keep only the
    # metrics, and let the disk settle first.
    rm -rf "$work/\$mode-\$steps/checkpoints" "$work/\$mode-\$steps/model"
    sync
  done
done
INNER
"$root/scripts/multihost" --hosts 2 --slots 2 --rate "$rate" -- bash "$work/runs.sh"
python3 - "$work" "$S1" "$S2" "$rate" "$SEQ" "$MODES" "$STAGE" "$BUCKET" <<'PY'
import csv, statistics, sys
work, s1, s2, rate, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
modes, stage = sys.argv[6].split(), int(sys.argv[7])
H, L = 2, 2
params = 0
with open(f"{work}/{modes[0]}-{s2}.log") as f:
    for line in f:
        if "parameters" in line and "M parameters" in line:
            params = float(line.split("M parameters")[0].split()[-1]) * 1e6
            break
def read(path):
    return {l.split()[0]: int(l.split()[1]) for l in open(path)}
def per_step(mode):
    out = {}
    for s in (s1, s2):
        b, a = read(f"{work}/{mode}-{s}.before"), read(f"{work}/{mode}-{s}.after")
        out[s] = {h: a[h] - b[h] for h in a}
    return {h: (out[s2][h] - out[s1][h]) / (s2 - s1) for h in out[s2]}
def steps_s(mode):  # every step of the longer run but its first (start-up)
    rows = list(csv.DictReader(open(f"{work}/{mode}-{s2}/metrics.csv")))
    tokens = 4 * seq
    return [tokens / float(r["tokens_per_s"]) for r in rows[1:]]
def step_s(mode):
    return statistics.median(steps_s(mode))
P = 4 * params
f, q, g = (H - 1) / H, (1 + 4 / 2048) / 4, (0.5 + 4 / 128) / 4
gathers = 1 if stage == 2 else 2  # parameter all-gathers per step
formula = {"flat": L * f * (gathers * P + P), "hier": f * (gathers * P + P), "qgz": f * (gathers * P + g * P),
           "hpz": f * (P + P), "qwz": f * (2 * q * P + P), "zeropp": f * (q * P + g * P)}
print(f"multihost zero{stage}: d768 GPT ({params / 1e6:.1f}M parameters, fp32), ZeRO-{stage}, {H} hosts x {L} ranks, "
      f"1 sample of {seq} tokens per rank, link {rate}, buckets of {sys.argv[8]} elements")
res = {}
for mode in modes:
    b = per_step(mode)
    t = step_s(mode)
    res[mode] = (b, t)
    for h, v in sorted(b.items()):
        print(f"  {mode:6s} {h}: {v / 1e6:8.1f} MB per step on its link; formula {formula[mode] / 1e6:8.1f} MB ({v / formula[mode]:.3f}x)")
    print(f"  {mode:6s} median step {t:.2f} s (steps {' '.join(f'{x:.2f}' for x in steps_s(mode))})")
def ratio(a, b, what):
    if a in res and b in res:
        print(f"multihost zero{stage}: {what}: link bytes {min(res[b][0].values()) / max(res[a][0].values()):.3f}x; "
              f"step {res[a][1] / res[b][1]:.2f}x faster")
ratio("flat", "hier", "hierarchical vs flat" + (" (target 1.5x faster)" if stage == 2 else ""))
ratio("flat", "qgz", "qgZ (hierarchical, 4-bit gradients across hosts) vs flat")
ratio("hier", "qgz", "qgZ vs hierarchical fp32")
ratio("hier", "hpz", "hpZ (backward gathers within the host) vs hierarchical")
ratio("hier", "qwz", "qwZ (int8 parameter all-gathers) vs hierarchical")
ratio("hier", "zeropp", "ZeRO++ (hpZ + qwZ + qgZ) vs hierarchical")
ratio("flat", "zeropp", "ZeRO++ vs flat")
PY
