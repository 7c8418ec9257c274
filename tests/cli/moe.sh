#!/bin/sh
# Mixture-of-Experts training (issue 39) against the plain single-process LibTorch reference
# (cli/reference_train.cpp: autograd, clip_grad_norm_, torch::optim::AdamW; the load-balancing
# loss added to its loss by hand, each data-parallel rank's micro-batch run as its own piece, as
# expert capacity is per rank). A GPT with 4 SwiGLU experts, 2 per token, DeepSpeed's capacity
# factor 1 (tokens dropped) and its auxiliary loss at 0.05: 2 ranks at ZeRO stages 0-3, gradient
# accumulation, activation checkpointing and 2 pipeline stages give the reference's losses and
# gradient norms; bf16 and fp16 (loss scaling: the auxiliary loss's gradient is scaled too)
# within 3%. Then expert parallelism (ep_size 2 and 4) likewise, tensor parallelism of the
# attention (tp 2, and tp 2 x ep 2), and checkpoints resharded to another ep_size. Judged by its
# exit status.
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
# Expert parallelism (model.moe.ep_size): the experts spread over the ranks, tokens exchanged by
# all-to-all, the experts' gradients reduced over the expert-data-parallel group. ep 2 at ZeRO
# 0-3 on 2 ranks; on 4 ranks (against the 4-piece reference) ep 4 at ZeRO 0-3 and ep 2 (2
# expert-data-parallel ranks) at 1 and 3; bf16; ep 2 with 2 pipeline stages and activation
# checkpointing on 4 ranks.
for stage in 0 1 2 3; do
  "$cli" train -c "$cfg" -n 2 --out ep2z$stage $sets --set model.moe.ep_size=2 --set zero_optimization.stage=$stage \
    --set zero_optimization.stage3_param_persistence_threshold=0 > ep2z$stage.log 2>&1 || { cat ep2z$stage.log; exit 1; }
  python3 "$compare" ep2z$stage/metrics.csv ref/metrics.csv 1e-4 --grad-norm
done
grep -q "expert parallel over 2 ranks (2 experts each)" ep2z0.log || { cat ep2z0.log; echo "FAIL no expert parallelism reported"; exit 1; }
"$ref" "$cfg" 4 ref4 $sets >/dev/null
for ep in 2 4; do
  stages="1 3"
  [ $ep = 4 ] && stages="0 1 2 3"
  for stage in $stages; do
    "$cli" train -c "$cfg" -n 4 --out ep${ep}n4z$stage $sets --set model.moe.ep_size=$ep --set zero_optimization.stage=$stage \
      --set zero_optimization.stage3_param_persistence_threshold=0 > ep${ep}n4z$stage.log 2>&1 || { cat ep${ep}n4z$stage.log; exit 1; }
    python3 "$compare" ep${ep}n4z$stage/metrics.csv ref4/metrics.csv 1e-4 --grad-norm
  done
done
"$cli" train -c "$cfg" -n 2 --out ep2bf16 $sets --set model.moe.ep_size=2 --set zero_optimization.stage=2 --set bf16.enabled=true \
  > ep2bf16.log 2>&1 || { cat ep2bf16.log; exit 1; }
python3 "$compare" ep2bf16/metrics.csv ref/metrics.csv 3e-2
"$ref" "$cfg" 2 ref_pp2 $sets --set gradient_accumulation_steps=4 --set train_micro_batch_size_per_gpu=2 >/dev/null
"$cli" train -c "$cfg" -n 4 --out ep2pp $sets --set model.moe.ep_size=2 --set pipeline.stages=2 --set zero_optimization.stage=1 \
  --set gradient_accumulation_steps=4 --set train_micro_batch_size_per_gpu=2 --set pipeline.activation_checkpoint_interval=1 \
  > ep2pp.log 2>&1 || { cat ep2pp.log; exit 1; }
python3 "$compare" ep2pp/metrics.csv ref_pp2/metrics.csv 1e-4 --grad-norm
# Tensor parallelism of the attention with the experts whole on each tensor-parallel rank: tp 2
# on 2 ranks (the 1-piece reference), and tp 2 x dp 2 with ep 2 at ZeRO-3 on 4 ranks.
"$ref" "$cfg" 1 ref1 $sets >/dev/null
"$cli" train -c "$cfg" -n 2 --out tp2 $sets --set tensor_parallel.tp_size=2 --set zero_optimization.stage=1 \
  > tp2.log 2>&1 || { cat tp2.log; exit 1; }
python3 "$compare" tp2/metrics.csv ref1/metrics.csv 1e-4 --grad-norm
"$cli" train -c "$cfg" -n 4 --out tp2ep2 $sets --set tensor_parallel.tp_size=2 --set model.moe.ep_size=2 \
  --set zero_optimization.stage=3 --set zero_optimization.stage3_param_persistence_threshold=0 > tp2ep2.log 2>&1 ||
  { cat tp2ep2.log; exit 1; }
python3 "$compare" tp2ep2/metrics.csv ref/metrics.csv 1e-4 --grad-norm
# Checkpoints reshard across ep_size (and stage): 4 steps at ep 2, resumed at ep 1 (2 ranks) and
# at ep 4 (4 ranks; from stage 0, where the first ep ranks each saved their own experts), equal
# to the reference over all 8 steps.
"$cli" train -c "$cfg" -n 2 --out rs2 $sets --set train.steps=4 --set model.moe.ep_size=2 --set zero_optimization.stage=2 \
  > rs2.log 2>&1 || { cat rs2.log; exit 1; }
"$cli" train -c "$cfg" -n 2 --out rs2 $sets --resume --set model.moe.ep_size=1 --set zero_optimization.stage=1 \
  > rs2b.log 2>&1 || { cat rs2b.log; exit 1; }
grep -q "resumed from .*rs2/checkpoints/global_step4 at step 4" rs2b.log || { cat rs2b.log; exit 1; }
python3 "$compare" rs2/metrics.csv ref/metrics.csv 1e-4 --grad-norm
"$cli" train -c "$cfg" -n 4 --out rs4 $sets --set train.steps=4 --set model.moe.ep_size=2 --set zero_optimization.stage=0 \
  > rs4.log 2>&1 || { cat rs4.log; exit 1; }
"$cli" train -c "$cfg" -n 4 --out rs4 $sets --resume --set model.moe.ep_size=4 --set zero_optimization.stage=3 \
  --set zero_optimization.stage3_param_persistence_threshold=0 > rs4b.log 2>&1 || { cat rs4b.log; exit 1; }
grep -q "resumed from .*rs4/checkpoints/global_step4 at step 4" rs4b.log || { cat rs4b.log; exit 1; }
python3 "$compare" rs4/metrics.csv ref4/metrics.csv 1e-4 --grad-norm
# The model an expert-parallel run saves holds every expert: the same text as the plain run's.
"$cli" generate --checkpoint ep2z2 --prompt "The " --max-new-tokens 16 --temperature 0 > gen_ep.txt
"$cli" generate --checkpoint z2 --prompt "The " --max-new-tokens 16 --temperature 0 > gen_plain.txt
cmp gen_ep.txt gen_plain.txt
# ep_size must divide the data-parallel size and the experts.
if "$cli" train -c "$cfg" -n 2 --out bad $sets --set model.moe.ep_size=4 > bad.log 2>&1; then
  echo "FAIL ep_size 4 on 2 ranks accepted"; exit 1
fi
grep -q "model.moe.ep_size 4 must divide the data-parallel size 2" bad.log || { cat bad.log; exit 1; }
# The trained model generates through the serving model as through the training stack.
"$cli" generate --checkpoint z2 --prompt "The " --max-new-tokens 16 --temperature 0 > gen.txt
test -s gen.txt || { echo "FAIL generate wrote nothing"; exit 1; }
echo CLI_MOE_PASSED
