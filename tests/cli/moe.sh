#!/bin/sh
# Mixture-of-Experts training (issue 39) against the plain single-process LibTorch reference
# (cli/reference_train.cpp: autograd, clip_grad_norm_, torch::optim::AdamW; the load-balancing
# loss added to its loss by hand, each data-parallel rank's micro-batch run as its own piece, as
# expert capacity is per rank). A GPT with 4 SwiGLU experts, 2 per token, DeepSpeed's capacity
# factor 1 (tokens dropped) and its auxiliary loss at 0.05: 2 ranks at ZeRO stages 0-3, gradient
# accumulation, activation checkpointing and 2 pipeline stages give the reference's losses and
# gradient norms; bf16 and fp16 (loss scaling: the auxiliary loss's gradient is scaled too)
# within 3%. Judged by its exit status.
# usage: moe.sh TORCHSPEED REFERENCE CONFIG COMPARE_LOSSES
set -eu
cli=$1 ref=$2 cfg=$3 compare=$4
rm -rf cli_moe && mkdir cli_moe && cd cli_moe
sets="--set train.steps=8 --set train.eval_interval=4 --set train.log_interval=1 --set model.activation=swiglu
  --set model.mlp_bias=false --set model.moe.num_experts=4 --set model.moe.k=2 --set model.moe.aux_loss_coef=0.05"
"$ref" "$cfg" 2 ref $sets >/dev/null
for stage in 0 1 2 3; do
  "$cli" train -c "$cfg" -n 2 --out z$stage $sets --set zero_optimization.stage=$stage \
    --set zero_optimization.stage3_param_persistence_threshold=0 > z$stage.log 2>&1 || { cat z$stage.log; exit 1; }
  python3 "$compare" z$stage/metrics.csv ref/metrics.csv 1e-4 --grad-norm
done
grep -q "experts" z2.log || { cat z2.log; echo "FAIL the run did not report its experts"; exit 1; }
# Gradient accumulation (the loss factor 1/2 reaches the auxiliary loss) with activation
# checkpointing (its gradient through the replay).
"$ref" "$cfg" 2 ref_acc $sets --set gradient_accumulation_steps=2 --set train_micro_batch_size_per_gpu=2 >/dev/null
"$cli" train -c "$cfg" -n 2 --out acc $sets --set gradient_accumulation_steps=2 --set train_micro_batch_size_per_gpu=2 \
  --set zero_optimization.stage=2 --set pipeline.activation_checkpoint_interval=1 > acc.log 2>&1 || { cat acc.log; exit 1; }
python3 "$compare" acc/metrics.csv ref_acc/metrics.csv 1e-4 --grad-norm
# Two pipeline stages (1F1B): each stage's layers get their auxiliary gradients in its backward.
"$ref" "$cfg" 1 ref_pp $sets --set gradient_accumulation_steps=4 --set train_micro_batch_size_per_gpu=2 >/dev/null
"$cli" train -c "$cfg" -n 2 --out pp $sets --set pipeline.stages=2 --set zero_optimization.stage=1 \
  --set gradient_accumulation_steps=4 --set train_micro_batch_size_per_gpu=2 > pp.log 2>&1 || { cat pp.log; exit 1; }
python3 "$compare" pp/metrics.csv ref_pp/metrics.csv 1e-4 --grad-norm
for p in bf16 fp16; do
  "$cli" train -c "$cfg" -n 2 --out $p $sets --set zero_optimization.stage=2 --set $p.enabled=true > $p.log 2>&1 ||
    { cat $p.log; exit 1; }
  python3 "$compare" $p/metrics.csv ref/metrics.csv 3e-2
done
# The trained model generates through the serving model as through the training stack.
"$cli" generate --checkpoint z2 --prompt "The " --max-new-tokens 16 --temperature 0 > gen.txt
test -s gen.txt || { echo "FAIL generate wrote nothing"; exit 1; }
echo CLI_MOE_PASSED
