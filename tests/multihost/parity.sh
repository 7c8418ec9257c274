#!/usr/bin/env bash
# Multi-host parity: 2 hosts x 2 ranks (network namespaces from scripts/multihost, links shaped
# to 1 Gbit/s, OpenMPI over TCP between hosts and shared memory within one) train the tiny GPT
#   - ZeRO-2, data parallel over all 4 ranks, and
#   - tp 2 inside each host x dp 2 across the hosts (ZeRO-1),
# and each run's losses, validation losses and gradient norms equal the independent
# single-process reference's (tests/cli/reference_train.cpp: plain LibTorch and torch::optim)
# within 1e-4, the tolerance of the one-host CLI parity tests. Prints the bytes each host sent.
#
# Usage: parity.sh CLI REFERENCE CONFIG   (exit 77 where namespaces cannot be created)
set -euo pipefail
cli="$1" ref="$2" cfg="$3"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
sets=(--set train.steps=8 --set train.eval_interval=4 --set train.log_interval=1)
work="$(mktemp -d /tmp/ts-multihost-parity.XXXXXX)"
trap 'rm -rf "$work"' EXIT

"$ref" "$cfg" 4 "$work/ref4" "${sets[@]}" >/dev/null
"$ref" "$cfg" 2 "$work/ref2" "${sets[@]}" >/dev/null

# Inside host 0: both runs, then each host's bytes sent on its link.
cat >"$work/runs.sh" <<INNER
set -euo pipefail
"$cli" launch --hostfile "\$TS_MH_HOSTFILE" -- "$cli" train -c "$cfg" --out "$work/zero2" \
  --set zero_optimization.stage=2 ${sets[*]} >"$work/zero2.log" 2>&1 || { cat "$work/zero2.log"; exit 1; }
"$cli" launch --hostfile "\$TS_MH_HOSTFILE" -- "$cli" train -c "$cfg" --out "$work/tp2dp2" \
  --set tensor_parallel.tp_size=2 --set zero_optimization.stage=1 ${sets[*]} >"$work/tp2dp2.log" 2>&1 ||
  { cat "$work/tp2dp2.log"; exit 1; }
for link in \$TS_MH_LINKS; do
  echo "link \$link sent \$(ip netns exec "\${link%%:*}" cat /sys/class/net/\${link#*:}/statistics/tx_bytes) bytes"
done
INNER
status=0
"$root/scripts/multihost" --hosts 2 --slots 2 --rate 1gbit -- bash "$work/runs.sh" >"$work/links.txt" || status=$?
[ "$status" = 0 ] || { cat "$work/links.txt"; exit "$status"; }
cat "$work/links.txt"
grep -h "ranks (dp" "$work/zero2.log" "$work/tp2dp2.log"
# The runs crossed the link: each host sent at least the gradients of a few steps (the tiny
# GPT's gradients are about 0.4 MB a step).
awk '/^link / { if ($4 < 1000000) { print "host " $2 " sent only " $4 " bytes: the ranks did not talk across the link"; bad = 1 } }
     END { exit bad }' "$work/links.txt"
python3 "$root/tests/cli/compare_losses.py" "$work/zero2/metrics.csv" "$work/ref4/metrics.csv" 1e-4 --grad-norm
python3 "$root/tests/cli/compare_losses.py" "$work/tp2dp2/metrics.csv" "$work/ref2/metrics.csv" 1e-4 --grad-norm
echo MULTIHOST_PARITY_PASSED
