#!/bin/sh
# GPT-2 in and out (issue 15): a model made by transformers and a tokenizer trained by
# `tokenizers` load in torchspeed with logits equal to transformers' (training and serving
# paths); torchspeed fine-tunes it on 2 ranks with ZeRO-1 (--init-from), exports it with
# `convert --format hf`, and transformers loads the export with logits equal to ours; `generate`
# on the export gives transformers' greedy continuation.
# usage: roundtrip.sh PYTHON TORCHSPEED GPT2_LOGITS
set -eu
py=$1 cli=$2 logits=$3
here=$(cd "$(dirname "$0")" && pwd)
rm -rf hf_roundtrip && mkdir hf_roundtrip && cd hf_roundtrip
"$py" "$here/gpt2_parity.py" make gpt2 --text text.txt
"$logits" gpt2 text.txt gpt2_ours.safetensors
"$py" "$here/gpt2_parity.py" check gpt2 gpt2_ours.safetensors --text text.txt
"$cli" train -c "$here/finetune.json" -n 2 --init-from gpt2 --out run > train.log 2>&1 || { cat train.log; exit 1; }
grep -q "initialized from" train.log || { cat train.log; echo "FAIL train did not say it initialized from gpt2"; exit 1; }
"$cli" convert run --format hf --to export
"$logits" run/model text.txt trained_ours.safetensors
"$cli" generate --checkpoint export --prompt "The" --max-new-tokens 8 --temperature 0 > generated.txt
"$py" "$here/gpt2_parity.py" check export trained_ours.safetensors --text text.txt --changed-from gpt2 \
  --generated generated.txt --prompt "The" --max-new-tokens 8
echo HF_GPT2_ROUNDTRIP_PASSED
