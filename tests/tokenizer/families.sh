#!/bin/sh
# Each family's pre-tokenizer (GPT-2's pattern; SmolLM's digits; Llama 3's and Qwen2's regex
# splits, Qwen2's NFC normalizer, Llama 3's ignore_merges; Llama 2's and Mistral's
# SentencePiece-style forms with byte fallback) in a BPE trained by Hugging Face's
# `tokenizers`: torchspeed's ids equal `tokenizers`' on every fortunes file and on a
# multilingual/emoji/code text (decoded back to the same bytes).
# usage: families.sh PYTHON ENCODE_FILES
set -eu
py=$1 encode=$2
here=$(cd "$(dirname "$0")" && pwd)
rm -rf tok_families && mkdir tok_families && cd tok_families
"$py" "$here/make_family_tokenizers.py" .
cp "$here/../data/multilingual.txt" .
printf 'e\314\201 A\314\212 \342\204\253 caf\303\251 cafe\314\201\n' > combining.txt
set -- multilingual.txt combining.txt
for f in /usr/share/games/fortunes/*; do
  case "$f" in *.dat|*.u8) continue ;; esac
  [ -f "$f" ] && [ ! -L "$f" ] && set -- "$@" "$f"
done
for kind in gpt2 smollm llama3 qwen2 llama2 mistral; do
  "$encode" "$kind" "$kind.ids.json" "$@"
  "$py" "$here/../hf/families_parity.py" tokens "$kind" "$kind.ids.json"
done
echo TOKENIZER_FAMILIES_PASSED
