#!/bin/sh
# torchspeed plan: --calibrate on 2 ranks writes a cluster with every micro-batch x tp point and
# the link; the search lists only layouts of 2 devices, fastest first; errors name the key; and
# the predicted peak memory of five layouts (ZeRO-1, ZeRO-2 with checkpointing, tp 2, Ulysses sp 2, an MoE
# model at ep 2) is within
# 10% of what training them measures (the peak of LibTorch's CPU allocations while the steps of
# an autotuning experiment run). Step times are benchmarks/plan_check.sh's, not a test's.
# usage: plan.sh TORCHSPEED
set -eu
cli=$1
rm -rf plan && mkdir plan && cd plan
model="--layers 2 --hidden 128 --heads 2 --seq 64 --vocab 256"
"$cli" plan --calibrate --out cluster.json -n 2 $model --max-micro 4 > calibrate.log 2>&1 || { cat calibrate.log; exit 1; }
cat calibrate.log
"$cli" plan --cluster cluster.json $model --batch 8 --top 5 --json search.json > search.log || { cat search.log; exit 1; }
cat search.log
cat > cfg.json <<'JSON'
{
  "train_batch_size": 8,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
  "zero_optimization": {"stage": 1, "reduce_bucket_size": 100000},
  "model": {"vocab": 256, "seq_len": 64, "d_model": 128, "n_layer": 2, "n_head": 2, "dropout": 0.0},
  "autotuning": {"enabled": true, "start_profile_step": 2, "end_profile_step": 4},
  "train": {"steps": 100, "eval_interval": 1000, "log_interval": 1, "checkpoint_interval": 0}
}
JSON
for case in "z1 dp=2,tp=1,pp=1,zero=1,micro=4,ckpt=0" "z2ckpt dp=2,tp=1,pp=1,zero=2,micro=4,ckpt=1" "tp2 dp=1,tp=2,pp=1,zero=0,micro=4,ckpt=0" \
    "sp2 dp=2,tp=1,pp=1,sp=2,zero=1,micro=4,ckpt=0" "ep2 dp=2,tp=1,pp=1,ep=2,zero=1,micro=4,ckpt=0"; do
  name=${case%% *} layout=${case#* }
  python3 - "$layout" "$name" <<'PY'
import json, sys
cfg = json.load(open("cfg.json"))
l = dict(kv.split("=") for kv in sys.argv[1].split(","))
cfg["train_micro_batch_size_per_gpu"] = int(l["micro"])
cfg["zero_optimization"]["stage"] = int(l["zero"])
if int(l["tp"]) > 1: cfg["tensor_parallel"] = {"tp_size": int(l["tp"])}
if int(l["ckpt"]): cfg["pipeline"] = {"activation_checkpoint_interval": 1}
if int(l.get("sp", 1)) > 1: cfg["sequence_parallel_size"] = int(l["sp"])
if int(l.get("ep", 1)) > 1:  # 4 SwiGLU experts of width 256, 2 per token, over ep ranks
    cfg["model"].update(activation="swiglu", mlp_bias=False, moe={"num_experts": 4, "k": 2, "d_ff": 256, "ep_size": int(l["ep"])})
cfg["autotuning"]["metric_path"] = sys.argv[2] + ".metrics.json"
json.dump(cfg, open(sys.argv[2] + ".json", "w"))
PY
  "$cli" train -c "$name.json" -n 2 --out "run-$name" > "$name.log" 2>&1 || { cat "$name.log"; exit 1; }
  "$cli" plan --cluster cluster.json --config "$name.json" --layout "$layout" --json "$name.plan.json" > /dev/null
done
"$cli" plan --cluster cluster.json $model --layout dp=4,tp=1,pp=1,zero=0,micro=1,ckpt=0 > bad.log 2>&1 && { echo "FAIL a layout of 4 devices on 2 was accepted"; exit 1; }
grep -q "dp x tp x pp = 4 but the cluster has 2 devices" bad.log || { cat bad.log; echo "FAIL the error does not say why"; exit 1; }
"$cli" plan --cluster cluster.json $model --layout dp=x,tp=1,pp=1,zero=0,micro=1,ckpt=0 > bad.log 2>&1 && { echo "FAIL dp=x was accepted"; exit 1; }
grep -q "layout dp: 'x' is not a whole number" bad.log || { cat bad.log; echo "FAIL the error does not name dp"; exit 1; }
"$cli" plan --cluster cluster.json $model --layout dp=2,tp=1,pp=1,zero=2,micro=0,ckpt=0 > bad.log 2>&1 && { echo "FAIL micro=0 was accepted"; exit 1; }
grep -q "must be >= 1" bad.log || { cat bad.log; echo "FAIL micro=0 not explained"; exit 1; }
"$cli" plan --cluster cluster.json --layers 2 > bad.log 2>&1 && { echo "FAIL a partial model was accepted"; exit 1; }
grep -q "hidden is missing" bad.log || { cat bad.log; echo "FAIL the missing flag is not named"; exit 1; }
echo '{"devices_per_node": 2, "memory": "lots"}' > bad.json
"$cli" plan --cluster bad.json $model > bad.log 2>&1 && { echo "FAIL a bad cluster file was accepted"; exit 1; }
grep -q "cluster.memory must be a number" bad.log || { cat bad.log; echo "FAIL the error does not name the key"; exit 1; }
python3 - <<'PY'
import json
c = json.load(open("cluster.json"))
pts = {(p["tp"], p["tokens"]) for p in c["compute"]}
assert pts == {(tp, 64 * m) for tp in (1, 2) for m in (1, 2, 4)}, "FAIL calibration points %s" % sorted(pts)
assert all(p["flops_per_s"] > 1e8 and 0 < p["forward_share"] < 1 for p in c["compute"]), "FAIL compute rates %s" % c["compute"]
assert c["intra"]["bandwidth"] > 1e7 and c["optimizer_rate"] > 1e6 and c["measured_devices"] == 2, "FAIL link or optimizer %s" % c
s = json.load(open("search.json"))["estimates"]
assert len(s) > 10, "FAIL only %d layouts" % len(s)
assert all(e["dp"] * e["tp"] * e["pp"] == 2 and e["dp"] // e["sp"] * e["micro"] * e["accumulation"] == 8 for e in s), "FAIL a layout not of 2 devices"
assert any(e["sp"] == 2 and e["a2a_bytes"] > 0 for e in s), "FAIL no sequence-parallel layout searched"
fit = [e["time"]["total"] for e in s if e["fits"]]
assert fit and fit == sorted(fit), "FAIL not fastest first (or nothing fits)"
for name in ("z1", "z2ckpt", "tp2", "sp2", "ep2"):
    m = json.load(open(name + ".metrics.json"))["peak_allocated_bytes"]
    p = json.load(open(name + ".plan.json"))["estimates"][0]["memory"]["total"]
    print("%-7s peak allocated %.2f MB, predicted %.2f MB (%.3fx)" % (name, m / 1e6, p / 1e6, p / m))
    assert abs(p / m - 1) <= 0.10, "FAIL %s: predicted peak %.2f MB, measured %.2f MB" % (name, p / 1e6, m / 1e6)
print("CLI_PLAN_PASSED")
PY
