#!/bin/sh
# The model families against transformers (issue 34): for each family (Llama 2 and 3.2, SmolLM2,
# Mistral, Qwen2, Qwen3; the Mixture-of-Experts Mixtral, Qwen2-MoE and Qwen3-MoE of issue 39), a
# random-initialised model made by transformers with its own config class loads in torchspeed with logits equal to transformers' on both our paths (training stack,
# serving model), and `torchspeed serve` gives the prompt's log-probabilities and 64 greedy tokens
# as transformers does (fp32; bf16 weights within a stated tolerance). Then the Llama 3.2 shape
# is fine-tuned on 2 ranks with ZeRO-2 (--init-from the folder), exported with `convert --format
# hf`, and the export loads in transformers with equal logits to ours, its weights changed; the
# same for the Mixtral shape (Mixture of experts, its load-balancing loss in the training loss).
# usage: families.sh PYTHON TORCHSPEED MODEL_LOGITS
set -eu
py=$1 cli=$2 logits=$3
here=$(cd "$(dirname "$0")" && pwd)
rm -rf hf_families && mkdir hf_families && cd hf_families
"$py" "$here/families_parity.py" make fam
for f in llama2 llama3 smollm2 mistral qwen2 qwen3 mixtral qwen2_moe qwen3_moe; do
  "$logits" "fam/$f" fam/text.txt "$f.safetensors"
  "$py" "$here/families_parity.py" logits "fam/$f" "$f.safetensors"
  "$py" "$here/families_parity.py" serve "fam/$f" --cli "$cli"
done
# Serving the MoE families on 2 ranks (--tp 2): attention split by heads, the experts spread over
# the ranks (half each; Qwen2-MoE's shared expert on the first), one all-reduce of the experts'
# sum per layer: the same greedy tokens, log-probabilities within 1e-4.
for f in mixtral qwen2_moe; do
  "$py" "$here/families_parity.py" serve "fam/$f" --cli "$cli" --tp 2
done
# bf16 weights: rounding each weight to 8 bits of mantissa moves these log-probabilities by up to
# a few hundredths (measured 0.02-0.05 on these random models); 0.1 bounds it.
for f in llama3 qwen3; do
  "$py" "$here/families_parity.py" serve "fam/$f" --cli "$cli" --weights bf16 --tol 0.1
done
"$cli" train -c "$here/finetune_zero2.json" -n 2 --init-from fam/llama3 --out run > train.log 2>&1 || { cat train.log; exit 1; }
grep -q "initialized from" train.log || { cat train.log; echo "FAIL train did not say it initialized from fam/llama3"; exit 1; }
"$cli" convert run --format hf --to export
"$logits" export fam/text.txt export.safetensors
"$py" "$here/families_parity.py" logits export export.safetensors
"$py" "$here/families_parity.py" changed export fam/llama3
"$cli" train -c "$here/finetune_zero2.json" -n 2 --init-from fam/mixtral --out run_moe > train_moe.log 2>&1 || { cat train_moe.log; exit 1; }
"$cli" convert run_moe --format hf --to export_moe
"$logits" export_moe fam/text.txt export_moe.safetensors
"$py" "$here/families_parity.py" logits export_moe export_moe.safetensors
"$py" "$here/families_parity.py" changed export_moe fam/mixtral
echo HF_FAMILIES_PASSED
