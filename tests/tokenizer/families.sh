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
cat > multilingual.txt <<'TEXT'
Grüße aus Zürich! Ça va? Καλημέρα κόσμε. Привет, мир! こんにちは世界 你好，世界 안녕하세요 🎉👍🏽
Combining: e\u0301 vs é; Ångström (A\u030A); ﬁ ligature; ½ ² ٣ ४ — “quotes” ‘single’ …
3.14159 and 1,000,000 $5.99 -- 12345678901234567890 I'M YOU'RE it's WE'LL they'd
def f(x):
	return x ** 2  # square
    if x != 0: print(f"{x:>10}")

   trailing spaces and lines   

<|im_start|>user
Hi<|im_end|>
<s>[INST] Why?  [/INST] Because.</s><s> again </s>
TEXT
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
