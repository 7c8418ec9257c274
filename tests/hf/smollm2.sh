#!/bin/sh
# A real model, SmolLM2-135M-Instruct from its Q4_1 GGUF (scripts/smollm2), against transformers
# reading the same file (dequantized to fp32): the GGUF's own tokenizer gives Hugging Face's ids
# on the fortunes corpus and on a multilingual/emoji/code text; logits equal on our training and
# serving paths; `torchspeed serve` gives the prompt's log-probabilities and 64 greedy tokens as
# transformers does, and through the model's own chat template answers "What is the capital of
# France?" with transformers' answer, which names Paris; `convert --format hf` of the GGUF writes
# a folder (its tokenizer as tokenizer.json) that transformers and `tokenizers` read alike.
# usage: smollm2.sh PYTHON TORCHSPEED MODEL_LOGITS ENCODE_FILES
set -eu
py=$1 cli=$2 logits=$3 encode=$4
here=$(cd "$(dirname "$0")" && pwd)
gguf=$("$here/../../scripts/smollm2")
rm -rf hf_smollm2 && mkdir hf_smollm2 && cd hf_smollm2
cp "$here/../data/multilingual.txt" .
set -- multilingual.txt
for f in /usr/share/games/fortunes/*; do
  case "$f" in *.dat|*.u8) continue ;; esac
  [ -f "$f" ] && [ ! -L "$f" ] && set -- "$@" "$f"
done
"$encode" "$gguf" ids.json "$@"
"$py" "$here/families_parity.py" tokens "$gguf" ids.json
head -c 400 /usr/share/games/fortunes/fortunes > text.txt
"$logits" "$gguf" text.txt ours.safetensors
"$py" "$here/families_parity.py" logits "$gguf" ours.safetensors --tol 2e-3
"$py" "$here/families_parity.py" serve "$gguf" --cli "$cli" --text text.txt --tol 2e-3 \
  --chat "What is the capital of France?" --expect Paris
# convert --format hf of the GGUF: the tokenizer written as tokenizer.json gives the same ids in
# Hugging Face's `tokenizers`, and transformers loads the folder with logits equal to ours.
"$cli" convert "$gguf" --format hf --to smol-hf
"$encode" smol-hf ids_hf.json multilingual.txt /usr/share/games/fortunes/fortunes /usr/share/games/fortunes/science
"$py" "$here/families_parity.py" tokens smol-hf ids_hf.json
"$logits" smol-hf text.txt smol_hf.safetensors
"$py" "$here/families_parity.py" logits smol-hf smol_hf.safetensors --tol 2e-3
rm -rf smol-hf
echo HF_SMOLLM2_PASSED
