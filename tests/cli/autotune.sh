#!/bin/sh
# torchspeed autotune (DeepSpeed's autotuner): every ZeRO stage x 2 micro-batch sizes run as
# experiments that stop after end_profile_step with their metrics; the summary holds all 8, each
# run used its own stage and micro-batch size, the best is the one with the highest throughput,
# and the optimal config (autotuning off) validates.
# usage: autotune.sh TORCHSPEED CONFIG
set -eu
cli=$1 cfg=$2
rm -rf autotune && mkdir autotune && cd autotune
"$cli" autotune -c "$cfg" -n 2 > autotune.log 2>&1 || { cat autotune.log; exit 1; }
cat autotune.log
python3 - <<'PY'
import json
s = json.load(open("autotune_results/summary.json"))
e = s["experiments"]
assert len(e) == 8, "FAIL expected 8 experiments, got %d" % len(e)
assert sorted((x["zero_stage"], x["train_micro_batch_size_per_gpu"]) for x in e) == [(z, m) for z in range(4) for m in (2, 8)], "FAIL search space"
for x in e:
    m = x["metrics"]
    assert m is not None, "FAIL %s failed: %s" % (x["name"], x["error"])
    assert m["zero_stage"] == x["zero_stage"] and m["train_micro_batch_size_per_gpu"] == x["train_micro_batch_size_per_gpu"], "FAIL %s ran another setting: %s" % (x["name"], m)
    assert m["throughput"] > 0 and m["latency"] > 0 and m["FLOPS_per_gpu"] > 0, "FAIL %s metrics %s" % (x["name"], m)
    assert abs(m["throughput"] - 2 * m["train_micro_batch_size_per_gpu"] * 1000.0 / m["latency"]) < 1e-6 * m["throughput"], "FAIL throughput != batch / latency"
best = max(e, key=lambda x: x["metrics"]["throughput"])
assert s["best"] == best["name"], "FAIL best %s, highest throughput %s" % (s["best"], best["name"])
o = json.load(open("autotune_results/ds_config_optimal.json"))
assert o["autotuning"]["enabled"] is False, "FAIL the optimal config still enables autotuning"
assert o["zero_optimization"]["stage"] == best["zero_stage"] and o["train_micro_batch_size_per_gpu"] == best["train_micro_batch_size_per_gpu"], "FAIL optimal config"
log = open("autotune_results/%s/stdout.log" % best["name"]).read()
assert "autotuning experiment:" in log and "step 4/5" in log and "step 5/5" not in log, "FAIL the experiment did not stop after end_profile_step:\n" + log
print("autotune checks passed")
PY
"$cli" config autotune_results/ds_config_optimal.json --world 2 > /dev/null
echo CLI_AUTOTUNE_PASSED
