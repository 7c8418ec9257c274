#!/usr/bin/env bash
# Elastic restart (Note [Elastic restart]): 2 hosts x 2 ranks (network namespaces from
# scripts/multihost) train the tiny GPT with ZeRO-2 under `torchspeed launch --max-restarts 2`,
# saving a checkpoint every 20 steps. Once one exists, host 1 dies: every process in it is
# killed and its link set down. The job must end, the launcher must name the host and its
# ranks, find that host 0 alone answers, and restart training there from `latest` at dp 2 with
# twice the gradient accumulation (the same global batch of 16). The resumed steps' losses,
# validation losses and gradient norms must equal, bit for bit, those of a run started at dp 2
# from a copy of the same checkpoint.
#
# HOW=link only sets host 1's link down and leaves its processes running: host 0's ranks then
# fail at their collective's deadline (TORCHSPEED_COMM_TIMEOUT_S, 20 s here), and mpirun, which
# cannot reach host 1's daemon, is stopped 10 s after it reports the abort (--abort-grace).
#
# Usage: [HOW=kill|link] elastic.sh CLI   (exit 77 where namespaces cannot be created)
set -euo pipefail
cli="$1"
how="${HOW:-kill}"
export TORCHSPEED_COMM_TIMEOUT_S=20
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="$(mktemp -d /tmp/ts-multihost-elastic.XXXXXX)"
trap 'rm -rf "$work"' EXIT
cat >"$work/cfg.json" <<'JSON'
{
  "train_batch_size": 16,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_clipping": 1.0,
  "seed": 1234,
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 5}},
  "zero_optimization": {"stage": 2, "reduce_bucket_size": 20000},
  "model": {"vocab": 256, "seq_len": 32, "d_model": 32, "n_layer": 2, "n_head": 2, "dropout": 0.1},
  "data": {"val_fraction": 0.1},
  "train": {"steps": 300, "eval_interval": 50, "eval_batches": 2, "log_interval": 1, "checkpoint_interval": 20}
}
JSON

# Inside host 0: the elastic job in the background; host 1 dies once a checkpoint exists.
cat >"$work/runs.sh" <<INNER
set -euo pipefail
set -- \$TS_MH_HOSTS
h1=\$2
"$cli" launch --hostfile "\$TS_MH_HOSTFILE" --max-restarts 2 --probe-timeout 20 --abort-grace 10 -- \
  "$cli" train -c "$work/cfg.json" --out "$work/elastic" --resume >"$work/elastic.log" 2>&1 &
job=\$!
for i in \$(seq 1 1200); do
  [ -e "$work/elastic/checkpoints/latest" ] && break
  kill -0 \$job 2>/dev/null || break
  sleep 0.1
done
[ -e "$work/elastic/checkpoints/latest" ] || { echo "no checkpoint was written"; cat "$work/elastic.log"; exit 1; }
echo "\$(date +%T) host \$h1 dies ($how) after \$(cat "$work/elastic/checkpoints/latest")"
[ "$how" = link ] || ip netns pids "\$h1" | xargs -r kill -9
ip -n "\$h1" link set eth0 down
status=0
wait \$job || status=\$?
echo "launcher exit status \$status at \$(date +%T)"
ip netns pids "\$h1" | xargs -r kill -9  # what a silent host still runs
exit \$status
INNER
status=0
"$root/scripts/multihost" --hosts 2 --slots 2 --rate 1gbit -- bash "$work/runs.sh" || status=$?
[ "$status" = 77 ] && exit 77
# What the launcher and the resumed run said (progress lines are long: only the messages).
grep -a -E "^launch:|resumed from|saved at dp|^done:|did not complete within" "$work/elastic.log" | cut -c1-240 || true
[ "$status" = 0 ] || { echo "the elastic job failed"; tail -c 3000 "$work/elastic.log"; exit 1; }
if [ "$how" = link ]; then
  grep -q "did not complete within 20 s of starting" "$work/elastic.log"
  grep -q "launch: mpirun has not ended 10 s after the job failed" "$work/elastic.log"
fi
grep -q "launch: host 198.18.0.2 (ranks 2-3 of 4) does not answer" "$work/elastic.log"
grep -q "launch: restarting on the 1 host that answers, 2 ranks instead of 4 (restart 1 of 2)" "$work/elastic.log"
grep -q "saved at dp 4, resumed at dp 2: global batch 16 kept (4 micro x 2 accumulation x 2 dp)" "$work/elastic.log"
tag=$(grep -a -o "resumed from [^ ]*/checkpoints/global_step[0-9]*" "$work/elastic.log" | tail -1 | sed 's|.*/||')
step=${tag#global_step}
[ -n "$step" ] && [ "$step" -gt 0 ] || { echo "the restarted run did not resume from a checkpoint"; exit 1; }

# The reference: a run started at dp 2 (one host, no namespaces) from a copy of that checkpoint.
mkdir -p "$work/ref/checkpoints"
cp -r "$work/elastic/checkpoints/$tag" "$work/ref/checkpoints/"
echo "$tag" >"$work/ref/checkpoints/latest"
"$cli" train -c "$work/cfg.json" -n 2 --out "$work/ref" --resume >"$work/ref.log" 2>&1 || { cat "$work/ref.log"; exit 1; }
python3 - "$work/elastic/metrics.csv" "$work/ref/metrics.csv" "$step" <<'PY'
import csv, sys
def rows(path, after):
    return {int(r["step"]): (r["loss"], r["val_loss"], r["grad_norm"]) for r in csv.DictReader(open(path)) if int(r["step"]) > after}
el, ref, k = rows(sys.argv[1], int(sys.argv[3])), rows(sys.argv[2], int(sys.argv[3])), int(sys.argv[3])
assert el and set(el) == set(ref), f"logged steps differ: {sorted(el)[:5]}... vs {sorted(ref)[:5]}..."
for s in sorted(el):
    assert el[s] == ref[s], f"step {s}: elastic run {el[s]} vs a run started at dp 2 from the same checkpoint {ref[s]}"
print(f"steps {k + 1}-{max(el)} after the restart: loss, validation loss and gradient norm equal the dp-2 run's bit for bit")
PY
echo MULTIHOST_ELASTIC_PASSED
