#!/bin/sh
# DeepSpeed-Ulysses sequence parallelism and ALST's tiling (issue 39) against the plain
# single-process LibTorch reference (cli/reference_train.cpp: whole sequences, autograd,
# clip_grad_norm_, torch::optim::AdamW). sequence_parallel_size P splits each sequence over P
# ranks, which exchange heads for tokens around attention: the losses and gradient norms equal
# the unsplit run's (1e-4) at P 2 and 4, ZeRO stages 0-3, with P x 2 ranks (two replicas), GQA
# with KV heads split and replicated (fewer KV heads than ranks), Qwen3's q/k norms, learned
# positions (GPT-2) and rotary ones (Llama), activation checkpointing, gradient accumulation;
# bf16 within 3%. The tiled MLP and tiled loss give the untiled losses, alone and with
# sequence parallelism. Bad shapes are refused naming the key. Judged by its exit status.
# usage: sequence.sh TORCHSPEED REFERENCE CONFIG COMPARE_LOSSES
set -eu
cli=$1 ref=$2 cfg=$3 compare=$4
rm -rf cli_sequence && mkdir cli_sequence && cd cli_sequence
base="--set train.steps=6 --set train.eval_interval=3 --set train.log_interval=1 --set model.n_head=4"
llama="$base --set model.positions=rope --set model.norm=rmsnorm --set model.activation=swiglu --set model.n_kv_head=2
  --set model.qkv_bias=false --set model.attn_out_bias=false --set model.mlp_bias=false"
z3="--set zero_optimization.stage3_param_persistence_threshold=0"
run() {  # run NAME RANKS ARGS...: trains, failing with the log
  name=$1 n=$2
  shift 2
  "$cli" train -c "$cfg" -n "$n" --out "$name" "$@" > "$name.log" 2>&1 || { cat "$name.log"; exit 1; }
}
"$ref" "$cfg" 1 ref_gpt $base >/dev/null
"$ref" "$cfg" 1 ref_llama $llama >/dev/null
"$ref" "$cfg" 2 ref_llama2 $llama >/dev/null
# sp 2 on 2 ranks: GPT-2 (learned positions offset per shard) at ZeRO 0 and 3, Llama (RoPE over
# the gathered sequence, 2 KV heads split) at 1 and 2.
run gpt_z0 2 $base --set sequence_parallel_size=2 --set zero_optimization.stage=0
python3 "$compare" gpt_z0/metrics.csv ref_gpt/metrics.csv 1e-4 --grad-norm
grep -q "sequence parallel (Ulysses) over 2 ranks: 16 tokens each" gpt_z0.log || { cat gpt_z0.log; echo "FAIL no sequence parallelism reported"; exit 1; }
run gpt_z3 2 $base $z3 --set sequence_parallel_size=2 --set zero_optimization.stage=3
python3 "$compare" gpt_z3/metrics.csv ref_gpt/metrics.csv 1e-4 --grad-norm
for stage in 1 2; do
  run llama_z$stage 2 $llama --set sequence_parallel_size=2 --set zero_optimization.stage=$stage
  python3 "$compare" llama_z$stage/metrics.csv ref_llama/metrics.csv 1e-4 --grad-norm
done
# sp 4: 2 KV heads for 4 ranks (each replicated on 2), ZeRO-3; GPT-2 at ZeRO-2.
run llama_sp4 4 $llama $z3 --set sequence_parallel_size=4 --set zero_optimization.stage=3
python3 "$compare" llama_sp4/metrics.csv ref_llama/metrics.csv 1e-4 --grad-norm
run gpt_sp4 4 $base --set sequence_parallel_size=4 --set zero_optimization.stage=2
python3 "$compare" gpt_sp4/metrics.csv ref_gpt/metrics.csv 1e-4 --grad-norm
# sp 2 x 2 replicas on 4 ranks (ZeRO over all 4), Qwen3's q/k norms, gradient accumulation and
# activation checkpointing.
"$ref" "$cfg" 2 ref_qk $llama --set model.qk_norm=true --set gradient_accumulation_steps=2 --set train_micro_batch_size_per_gpu=2 >/dev/null
run qk_dp2 4 $llama --set model.qk_norm=true --set sequence_parallel_size=2 --set zero_optimization.stage=2 \
  --set gradient_accumulation_steps=2 --set train_micro_batch_size_per_gpu=2 --set pipeline.activation_checkpoint_interval=1
python3 "$compare" qk_dp2/metrics.csv ref_qk/metrics.csv 1e-4 --grad-norm
grep -q "batch 8 = 2 micro x 2 accumulation x 2 dp / sp 2" qk_dp2.log || { cat qk_dp2.log; echo "FAIL batch not counted per replica"; exit 1; }
# ALST's tiling: the MLP over 3 slices and the head with its loss over 3 (uneven) slices, on one
# rank at ZeRO-0 and with sp 2 at ZeRO-3 (its gathered layers replayed per slice) and ZeRO-2.
run tiled1 1 $llama --set torchspeed.tiled_mlp=3 --set torchspeed.tiled_loss=3
python3 "$compare" tiled1/metrics.csv ref_llama/metrics.csv 1e-4 --grad-norm
grep -q "tiled (ALST): MLP over 3 slices, LM head and loss over 3 slices" tiled1.log || { cat tiled1.log; exit 1; }
run tiled_sp2z3 2 $llama $z3 --set sequence_parallel_size=2 --set zero_optimization.stage=3 \
  --set torchspeed.tiled_mlp=3 --set torchspeed.tiled_loss=3
python3 "$compare" tiled_sp2z3/metrics.csv ref_llama/metrics.csv 1e-4 --grad-norm
run tiled_gpt 2 $base --set sequence_parallel_size=2 --set zero_optimization.stage=2 --set torchspeed.tiled_mlp=2 \
  --set torchspeed.tiled_loss=4 --set pipeline.activation_checkpoint_interval=1
python3 "$compare" tiled_gpt/metrics.csv ref_gpt/metrics.csv 1e-4 --grad-norm
run bf16 2 $llama --set sequence_parallel_size=2 --set zero_optimization.stage=2 --set bf16.enabled=true
python3 "$compare" bf16/metrics.csv ref_llama/metrics.csv 3e-2
# Refused, naming the key: sp that does not divide the ranks, a sequence that does not split,
# heads that do not split, tensor parallelism alongside.
refused() {  # refused NAME RANKS PATTERN ARGS...
  name=$1 n=$2 pattern=$3
  shift 3
  if "$cli" train -c "$cfg" -n "$n" --out "$name" "$@" > "$name.log" 2>&1; then
    cat "$name.log"; echo "FAIL $name was accepted"; exit 1
  fi
  grep -q "$pattern" "$name.log" || { cat "$name.log"; echo "FAIL $name: no '$pattern'"; exit 1; }
}
refused bad_div 2 "sequence_parallel_size: 4 does not divide the data-parallel size 2" $base --set sequence_parallel_size=4
refused bad_seq 2 "data.seq_len 31 is not a multiple of sequence_parallel_size 2" $base --set sequence_parallel_size=2 --set data.seq_len=31
refused bad_heads 2 "must divide the attention heads" $base --set model.n_head=1 --set sequence_parallel_size=2
refused bad_tp 4 "sequence_parallel_size: 2 with tensor_parallel.tp_size 2" $base --set sequence_parallel_size=2 --set tensor_parallel.tp_size=2
echo "sequence parallelism: every case matched the reference"
