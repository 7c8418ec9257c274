#!/bin/sh
# LoRA fine-tuning under ZeRO (issue 38): a base GPT trained here, then an adapter on its
# c_attn, attention and MLP c_proj and c_fc (GPT-2's module names) trained on 2 ranks at ZeRO
# stages 0, 2 and 3, each with the losses and gradient norms of the plain single-process
# LibTorch reference (torch::optim::AdamW over the adapter's parameters only); bf16 within 3%.
# Only the adapter is in the checkpoint; the run writes it in PEFT's format (OUT/adapter) and
# the merged model (OUT/model), and `serve --lora-modules` on the base answers greedy requests
# with the merged model's tokens. Judged by its exit status.
# usage: lora.sh TORCHSPEED REFERENCE CONFIG COMPARE_LOSSES
set -eu
cli=$1 ref=$2 cfg=$3 compare=$4
rm -rf cli_lora && mkdir cli_lora && cd cli_lora
sets="--set train.steps=8 --set train.eval_interval=4 --set train.log_interval=1"
lora="--set lora.r=4 --set lora.lora_alpha=16 --set lora.target_modules=[\"c_attn\",\"c_proj\",\"c_fc\"]"
"$cli" train -c "$cfg" --out base --set train.steps=4 >/dev/null
"$ref" "$cfg" 2 ref --init-from base/model $sets $lora >/dev/null
for stage in 0 2 3; do
  "$cli" train -c "$cfg" -n 2 --init-from base/model --out z$stage $sets $lora --set zero_optimization.stage=$stage \
    --set zero_optimization.stage3_param_persistence_threshold=0 > z$stage.log 2>&1 || { cat z$stage.log; exit 1; }
  python3 "$compare" z$stage/metrics.csv ref/metrics.csv 1e-4 --grad-norm
done
grep -q "LoRA: r 4" z2.log || { cat z2.log; echo "FAIL the run did not report its adapter"; exit 1; }
"$cli" train -c "$cfg" -n 2 --init-from base/model --out bf $sets $lora --set zero_optimization.stage=2 \
  --set bf16.enabled=true > bf.log 2>&1 || { cat bf.log; exit 1; }
python3 "$compare" bf/metrics.csv ref/metrics.csv 3e-2
python3 - <<'PY'
import json, struct
def names(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return sorted(k for k in json.loads(f.read(n)) if k != "__metadata__")
ckpt = names("z2/checkpoints/global_step8/rank00000.safetensors")
adapter = names("z2/adapter/adapter_model.safetensors")
cfg = json.load(open("z2/adapter/adapter_config.json"))
assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 16, cfg
assert sorted(cfg["target_modules"]) == ["c_attn", "c_fc", "c_proj"] and cfg["fan_in_fan_out"], cfg
assert len(adapter) == 2 * 4 * 2 and all(".lora_" in k for k in adapter), adapter  # 2 layers x 4 modules x A, B
assert adapter[0].startswith("base_model.model.transformer.h.0."), adapter[0]
print("adapter:", len(adapter), "tensors; checkpoint shard:", len(ckpt), "tensors")
PY
# The checkpoint holds the adapter's optimizer state only: no base weight.
python3 -c "
import json
m = json.load(open('z2/checkpoints/global_step8/manifest.json'))
names = json.dumps(m)
assert 'lora' in names and 'qkv.weight' not in names, 'the manifest lists base weights'
print('manifest: adapter only')"
# The adapter served on the base gives the merged model's greedy tokens.
"$cli" generate --checkpoint z2/model --prompt "The " --max-new-tokens 24 --temperature 0 > merged.txt
port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
"$cli" serve --checkpoint base/model --port "$port" --served-model-name base --lora-modules "tuned=z2/adapter" > serve.log 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
python3 - "$port" <<'PY'
import json, sys, time, urllib.request
port = int(sys.argv[1])
for _ in range(240):
    try:
        urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=2)
        break
    except OSError:
        time.sleep(0.25)
def ask(model):
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": model, "prompt": "The ", "max_tokens": 24, "temperature": 0}).encode())
    return json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]["text"]
merged = open("merged.txt").read()
tuned, base = ask("tuned"), ask("base")
print("served adapter:", repr(tuned), "| base:", repr(base))
assert tuned in merged, "the served adapter's tokens %r are not the merged model's %r" % (tuned, merged)
assert tuned != base, "the adapter changed nothing"
PY
kill $pid
wait $pid || true
echo CLI_LORA_PASSED
