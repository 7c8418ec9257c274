#!/bin/sh
# `torchspeed convert --format gguf` in F16, BF16, Q8_0, Q4_0 and Q4_1 (issues 34, 36): every tensor equals what
# llama.cpp's own Python package (gguf-py) makes of the F32 file's tensor, byte for byte, and the
# files parse in gguf-py's reader with the same metadata. Models: SmolLM2's shape and Qwen3 (q/k
# norms) made by transformers (families_parity.py make). `serve` takes a Q8_0 file as int8 weights,
# a Q4_0 / Q4_1 one as q4_0 / q4_1.
# usage: gguf_writer.sh PYTHON TORCHSPEED
set -eu
py=$1 cli=$2
here=$(cd "$(dirname "$0")" && pwd)
rm -rf gguf_writer && mkdir gguf_writer && cd gguf_writer
"$py" "$here/families_parity.py" make fam > make.log
for f in smollm2 qwen3; do
  for d in fp32 fp16 bf16 q8_0 q4_0 q4_1; do
    "$cli" convert "fam/$f" --format gguf --dtype "$d" --to "$f-$d.gguf"
  done
  "$py" "$here/llamacpp_parity.py" writer "$f-fp32.gguf" "$f-fp16.gguf" "$f-bf16.gguf" "$f-q8_0.gguf" "$f-q4_0.gguf" "$f-q4_1.gguf"
done
# serve's default --weights auto: a Q8_0 file is served in our int8 format, a Q4_0 one in q4_0,
# an F16 one in fp32.
for d in q8_0 q4_0 q4_1 fp16; do
  port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$cli" serve --checkpoint "smollm2-$d.gguf" --port "$port" > "serve-$d.log" 2>&1 &
  pid=$!
  i=0
  until grep -q "ready in" "serve-$d.log"; do
    i=$((i + 1))
    if [ $i -gt 600 ] || ! kill -0 $pid 2>/dev/null; then kill $pid 2>/dev/null; cat "serve-$d.log"; exit 1; fi
    sleep 0.1
  done
  kill $pid
  wait $pid || true
  want=fp32
  [ $d = q8_0 ] && want=int8
  [ $d = q4_0 ] && want=q4_0
  [ $d = q4_1 ] && want=q4_1
  grep -q "parameters, $want weights" "serve-$d.log" || { cat "serve-$d.log"; echo "serve --weights auto: $d is not served as $want"; exit 1; }
done
echo GGUF_WRITER_PASSED
