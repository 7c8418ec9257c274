#!/bin/sh
# `torchspeed convert --format gguf` in F16, BF16 and Q8_0 (issue 34): every tensor equals what
# llama.cpp's own Python package (gguf-py) makes of the F32 file's tensor, byte for byte, and the
# files parse in gguf-py's reader with the same metadata. Models: SmolLM2's shape and Qwen3 (q/k
# norms) made by transformers (families_parity.py make).
# usage: gguf_writer.sh PYTHON TORCHSPEED
set -eu
py=$1 cli=$2
here=$(cd "$(dirname "$0")" && pwd)
rm -rf gguf_writer && mkdir gguf_writer && cd gguf_writer
"$py" "$here/families_parity.py" make fam > make.log
for f in smollm2 qwen3; do
  for d in fp32 fp16 bf16 q8_0; do
    "$cli" convert "fam/$f" --format gguf --dtype "$d" --to "$f-$d.gguf"
  done
  "$py" "$here/llamacpp_parity.py" writer "$f-fp32.gguf" "$f-fp16.gguf" "$f-bf16.gguf" "$f-q8_0.gguf"
done
echo GGUF_WRITER_PASSED
