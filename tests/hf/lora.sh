#!/bin/sh
# LoRA adapters in PEFT's format against PEFT (issue 38): adapters that PEFT made on
# transformers' Qwen2 and SmolLM2 shapes are served beside their base (--lora-modules), the base
# and two adapters batched together, each with PEFT's log-probabilities and greedy tokens (tp 1
# and tp 2); adapter settings we do not compute are refused by name. Then an adapter trained here
# on the SmolLM2 shape (2 ranks, ZeRO-2, all seven linears, rsLoRA) loads in PEFT, whose logits
# equal those of our model with it merged (training stack and serving model). See lora_parity.py.
# usage: lora.sh PYTHON TORCHSPEED MODEL_LOGITS
set -eu
py=$1 cli=$2 logits=$3
here=$(cd "$(dirname "$0")" && pwd)
rm -rf hf_lora && mkdir hf_lora && cd hf_lora
"$py" "$here/lora_parity.py" make r
"$py" "$here/lora_parity.py" serve r/smollm2 --cli "$cli"
"$py" "$here/lora_parity.py" serve r/qwen2 --cli "$cli" --tp 2
"$py" "$here/lora_parity.py" refuse r/smollm2 --cli "$cli"
"$cli" train -c "$here/lora_train.json" -n 2 --init-from r/smollm2 --out run > train.log 2>&1 || { cat train.log; exit 1; }
"$logits" run/model r/text.txt merged.safetensors
"$py" "$here/lora_parity.py" peft r/smollm2 run/adapter merged.safetensors
echo HF_LORA_PASSED
