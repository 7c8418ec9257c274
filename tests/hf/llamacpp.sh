#!/bin/sh
# `torchspeed convert --format gguf` output runs in llama.cpp (issue 34), built from PyPI's
# llama-cpp-python sdist (scripts/llamacpp-env): for SmolLM2-135M-Instruct (its GGUF read here,
# written back in F32 and Q8_0) and random-initialised models made by transformers (SmolLM2's
# shape, Mistral with head_dim apart and linear rope scaling, Qwen2 with q/k/v biases, Qwen3 with
# q/k norms, and a Llama with a SentencePiece-style tokenizer with byte fallback), llama.cpp
# tokenizes as torchspeed does, its logits equal ours (F32 KV cache) and its greedy tokens are
# ours (llamacpp_parity.py). (F16, BF16 and Q8_0 files are checked byte for byte against gguf-py's
# quantizers in gguf_writer.sh; this llama.cpp build crashes in its quantized CPU kernels on the
# Sapphire Rapids machine it was written on, on SmolLM2's original Q4_1 file too.)
# usage: llamacpp.sh PYTHON TORCHSPEED MODEL_LOGITS ENCODE_FILES
set -eu
py=$1 cli=$2 logits=$3 encode=$4
here=$(cd "$(dirname "$0")" && pwd)
gguf=$("$here/../../scripts/smollm2")
rm -rf llamacpp && mkdir llamacpp && cd llamacpp
cp "$here/../data/multilingual.txt" .
head -c 2000 /usr/share/games/fortunes/fortunes > text.txt
check() {
  "$py" "$here/llamacpp_parity.py" check "$@" --encode "$encode" --logits "$logits" --text text.txt \
    --files multilingual.txt /usr/share/games/fortunes/science
}
"$cli" convert "$gguf" --format gguf --to smollm2-f32.gguf
check smollm2-f32.gguf
"$py" "$here/families_parity.py" make fam > make.log
"$py" "$here/llamacpp_parity.py" make fam fam/tokenizer
for f in smollm2 mistral qwen3 qwen2 spm; do
  "$cli" convert "fam/$f" --format gguf --to "$f.gguf"
  check "$f.gguf"
done
echo LLAMACPP_PASSED
