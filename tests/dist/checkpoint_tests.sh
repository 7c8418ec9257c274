#!/usr/bin/env bash
# Checkpoint tests across fresh processes, driven by checkpoint_driver.
#   checkpoint_tests.sh resume|reshard|faults DRIVER "MPIRUN FLAGS..."
# resume:  for ZeRO 0-3 x fp32/bf16 (and fp16 at stage 2) at dp 2: train 6 steps saving at step 3; new processes load
#          step 3 and train to 6. Losses (exact hex) and final fp32 masters must be identical.
# reshard: dp 4 stage 3 -> dp 2 stage 1 -> dp 1 stage 2: each load, saved again at once, has the
#          same full optimizer state, also through offloaded engines (dp 2 stage 3 with optimizer and
#          parameters on disk, dp 1 stage 2); training on from each agrees with dp 4 (fp32 tolerance).
# faults:  SIGKILL during a save and after each step of publishing a re-save, truncated and
#          bit-flipped shards, an unwritable folder, a save called by one rank only, `latest`
#          failing after the tag was published, keep_last (and a tag being read kept from it).
set -euo pipefail
suite=$1 driver=$2 mpirun=$3
work=$(mktemp -d "${TMPDIR:-/tmp}/ts-ckpt-XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
run() { local np=$1; shift; $mpirun -np "$np" "$driver" "$@"; }
fail() { echo "FAILED: $*"; exit 1; }

case $suite in
resume)
  for stage in 0 1 2 3; do
    precs="fp32 bf16"
    [ $stage = 2 ] && precs="fp32 bf16 fp16"  # fp16: the loss scaler continues too
    for prec in $precs; do
      d=c-$stage-$prec
      run 2 --stage $stage --precision $prec --steps 6 --save $d --save-at 3 --out straight-$d >/dev/null
      run 2 --stage $stage --precision $prec --steps 6 --load $d --out resumed-$d >/dev/null
      # straight holds steps 1-6, resumed steps 4-6.
      tail -n 3 straight-$d.losses | diff - resumed-$d.losses >/dev/null ||
        { paste straight-$d.losses resumed-$d.losses; fail "losses differ after resume ($stage $prec)"; }
      cmp straight-$d.params.safetensors resumed-$d.params.safetensors ||
        fail "final parameters differ after resume ($stage $prec)"
      [ "$(cat $d/latest)" = global_step3 ] || fail "latest is '$(cat $d/latest)'"
      echo "resume ok: stage $stage $prec"
    done
  done
  # Pipeline stages (pp 2): each stage's slice saved and resumed exactly, tied weights included.
  run 2 --pp 2 --stage 1 --steps 6 --save pp --save-at 3 --out straight-pp >/dev/null
  run 2 --pp 2 --stage 1 --steps 6 --load pp --out resumed-pp >/dev/null
  tail -n 3 straight-pp.losses | diff - resumed-pp.losses >/dev/null || fail "losses differ after a pipeline resume"
  cmp straight-pp.params.safetensors resumed-pp.params.safetensors || fail "parameters differ after a pipeline resume"
  echo "resume ok: pp 2 ZeRO-1"
  # Tensor parallelism (tp 2): each rank's slice saved and resumed exactly; convert joins the slices.
  run 2 --tp 2 --stage 1 --steps 6 --save tp --save-at 3 --out straight-tp >/dev/null
  run 2 --tp 2 --stage 1 --steps 6 --load tp --out resumed-tp >/dev/null
  tail -n 3 straight-tp.losses | diff - resumed-tp.losses >/dev/null || fail "losses differ after a tensor-parallel resume"
  cmp straight-tp.params.safetensors resumed-tp.params.safetensors || fail "parameters differ after a tensor-parallel resume"
  echo "resume ok: tp 2 ZeRO-1"
  # The manifest holds what the issue lists.
  python3 - c-2-bf16/global_step3/manifest.json <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
for k in ["torchspeed_version", "config", "grid", "global_step", "engine", "params", "zero", "files", "ranks"]:
    assert k in m, k
assert "loss_scaler" in m["engine"] and "lr_schedule" in m["engine"]
assert all("rng_cpu" in r and "data" in r["client_state"] for r in m["ranks"]), "per-rank RNG and data position"
assert all("crc32c" in f and "bytes" in f for f in m["files"].values()), "checksums"
print("manifest ok")
PY
  ;;
reshard)
  # No dropout: ranks of jobs of different sizes draw different masks, and training is compared.
  common="--dropout 0 --gas 1 --precision fp32"
  run 4 $common --stage 3 --steps 2 --save dp4 --save-at 2 >/dev/null
  # Load and save again at once: the full state must come through bit for bit.
  run 2 $common --stage 1 --steps 2 --load dp4 --save dp2 --save-at 2 --stop-after-save >/dev/null
  run 1 $common --stage 2 --steps 2 --load dp2 --save dp1 --save-at 2 --stop-after-save >/dev/null
  run 1 --compare dp4/global_step2 dp2/global_step2 | grep -q STATES_EQUAL || fail "dp 4 stage 3 -> dp 2 stage 1 changed the state"
  run 1 --compare dp4/global_step2 dp1/global_step2 | grep -q STATES_EQUAL || fail "dp 2 stage 1 -> dp 1 stage 2 changed the state"
  echo "reshard states equal: dp4 z3 -> dp2 z1 -> dp1 z2"
  # The same through offloaded engines: loaded into swap files and saved from them.
  mkdir -p swap
  run 2 $common --stage 3 --steps 2 --load dp4 --offload "$work/swap" --save dp2o --save-at 2 --stop-after-save >/dev/null
  run 1 $common --stage 2 --steps 2 --load dp2o --offload "$work/swap" --save dp1o --save-at 2 --stop-after-save >/dev/null
  run 1 --compare dp4/global_step2 dp2o/global_step2 | grep -q STATES_EQUAL || fail "dp 4 -> dp 2 stage 3 offloaded changed the state"
  run 1 --compare dp4/global_step2 dp1o/global_step2 | grep -q STATES_EQUAL || fail "dp 2 -> dp 1 stage 2 offloaded changed the state"
  echo "reshard states equal through offloaded engines: dp4 z3 -> dp2 z3 (optimizer and parameters on disk) -> dp1 z2 (optimizer on disk)"
  # Training on from the same checkpoint at dp 4, 2 and 1: same global batches, same losses up to
  # the order of floating-point sums.
  run 4 $common --stage 3 --steps 5 --load dp4 --out on4 >/dev/null
  run 2 $common --stage 1 --steps 5 --load dp4 --out on2 >/dev/null
  run 1 $common --stage 0 --steps 5 --load dp4 --out on1 >/dev/null
  python3 - on4.losses on2.losses on1.losses <<'PY'
import sys
runs = [[float.fromhex(l.split()[1]) for l in open(f)] for f in sys.argv[1:]]
assert len(runs[0]) == 3 and all(len(r) == 3 for r in runs), runs
for r in runs[1:]:
    for a, b in zip(runs[0], r):
        assert abs(a - b) <= 1e-5 * abs(a), (runs[0], r)
print("losses after reshard agree:", runs)
PY
  ;;
faults)
  common="--stage 2 --precision fp32"
  run 2 $common --steps 4 --out straight >/dev/null
  run 2 $common --steps 2 --save k --save-at 2 --stop-after-save >/dev/null
  # A failure on one rank while writing: every rank reports it, nothing is published, training goes on.
  run 2 $common --steps 4 --load k --save k --save-at 3 --fault fail:1 --out failed-save | tee out.txt >/dev/null
  grep -q "SAVE_FAILED: .*failed on rank 1: .*injected failure" out.txt || { cat out.txt; fail "no clear error for a failed shard write"; }
  [ "$(cat k/latest)" = global_step2 ] && [ ! -e k/global_step3 ] || fail "a failed save was published"
  tail -n 2 straight.losses | diff - failed-save.losses >/dev/null || fail "a failed save changed training"
  cmp straight.params.safetensors failed-save.params.safetensors || fail "a failed save changed the parameters"
  echo "failed write ok"
  # Writing latest fails once the tag is in place: the error says the tag is published and what
  # latest still names; the tag is complete and loads by its name.
  rm -rf lf && cp -r k lf
  run 2 $common --steps 4 --load lf --save lf --save-at 3 --fault publish-fail:latest --out latest-failed | tee out.txt >/dev/null
  grep -q "SAVE_FAILED: .*injected failure.*published at lf/global_step3, but lf/latest still names the previous tag 'global_step2'" out.txt ||
    { cat out.txt; fail "no truthful error for a failed latest"; }
  [ "$(cat lf/latest)" = global_step2 ] && [ -f lf/global_step3/manifest.json ] || fail "after a failed latest: $(ls -a lf)"
  run 1 --compare lf/global_step3 lf/global_step3 | grep -q STATES_EQUAL || fail "the published lf/global_step3 does not load"
  echo "failed latest ok"
  # SIGKILL of rank 1 in the middle of saving step 4: latest still names step 2, which loads.
  if run 2 $common --steps 4 --load k --save k --save-at 4 --fault kill:1 >/dev/null 2>&1; then fail "the killed job succeeded"; fi
  [ "$(cat k/latest)" = global_step2 ] || fail "latest is '$(cat k/latest)' after a killed save"
  [ ! -e k/global_step4 ] || fail "a killed save left k/global_step4"
  run 2 $common --steps 4 --load k --out after-kill >/dev/null
  tail -n 2 straight.losses | diff - after-kill.losses >/dev/null || fail "resuming after the killed save differs"
  echo "killed save ok"
  # Re-saving the tag latest names, killed after each step of publishing: latest always names a
  # complete checkpoint that loads and resumes exactly, and the next save removes what the dead
  # job left, and nothing of a live job's or another host's.
  h=$(hostname | tr -c 'A-Za-z0-9._\n' '_')
  sh -c 'exit 0' & dead=$!; wait $dead
  # Both ways of replacing the tag: renameat2's exchange, and moving the old one aside.
  for mode in exchange aside; do
  steps="manifest rename latest cleanup"
  [ $mode = aside ] && export TORCHSPEED_CHECKPOINT_NO_EXCHANGE=1 && steps="manifest aside rename latest cleanup"
  for step in $steps; do
    rm -rf rs && cp -r k rs
    if run 2 $common --steps 2 --load rs --save rs --save-at 2 --stop-after-save --fault publish:$step >/dev/null 2>&1; then
      fail "the re-save killed after '$step' succeeded"
    fi
    # (Killed between moving the old tag aside and renaming the new one, the tag is missing:
    # loading reads the .old folder, the next save gives it its name back.)
    [ "$(cat rs/latest)" = global_step2 ] && { [ -f rs/global_step2/manifest.json ] || [ $step = aside ]; } ||
      fail "after a re-save killed at '$step': $(ls -a rs)"
    run 2 $common --steps 4 --load rs --out resaved-$mode-$step >/dev/null
    tail -n 2 straight.losses | diff - resaved-$mode-$step.losses >/dev/null || fail "resuming after a re-save killed at '$step' differs"
    mkdir rs/.global_step9.tmp-$h-$$-1 rs/.global_step8.tmp-otherhost-1-1 rs/.global_step7.tmp-$h-$dead-1
    run 2 $common --steps 2 --load rs --save rs --save-at 2 --stop-after-save >/dev/null
    left=$(cd rs && ls -a | grep -E '\.(tmp|old)-' | sort | tr '\n' ' ')
    [ "$left" = ".global_step8.tmp-otherhost-1-1 .global_step9.tmp-$h-$$-1 " ] || fail "after a re-save ($mode) killed at '$step', left: $left"
  done
  done
  unset TORCHSPEED_CHECKPOINT_NO_EXCHANGE
  echo "killed re-saves ok (exchange and move aside)"
  # Damaged shards are named, and the engine keeps its state: training from scratch equals straight.
  cp -r k t && truncate -s -100 t/global_step2/rank00001.safetensors
  run 2 $common --steps 4 --try-load t --out truncated | tee out.txt >/dev/null
  grep -q "LOAD_FAILED: .*rank00001.safetensors: truncated" out.txt || { cat out.txt; fail "truncation not named"; }
  diff straight.losses truncated.losses >/dev/null || fail "a failed load changed the engine"
  cp -r k b && python3 -c "
import sys; p='b/global_step2/rank00000.safetensors'; d=bytearray(open(p,'rb').read()); d[len(d)//2]^=0x10; open(p,'wb').write(d)"
  run 2 $common --steps 4 --try-load b --out flipped | tee out.txt >/dev/null
  grep -q "LOAD_FAILED: .*rank00000.safetensors: checksum mismatch" out.txt || { cat out.txt; fail "bit flip not detected"; }
  diff straight.losses flipped.losses >/dev/null || fail "a failed load changed the engine"
  cp -r k m && rm m/global_step2/rank00001.safetensors
  run 2 $common --steps 4 --try-load m --out missing | tee out.txt >/dev/null
  grep -q "LOAD_FAILED: .*rank00001.safetensors.*No such file" out.txt || { cat out.txt; fail "missing shard not named"; }
  diff straight.losses missing.losses >/dev/null || fail "a failed load changed the engine"
  # Another model: the parameter and both shapes are named.
  run 2 $common --steps 1 --d-model 48 --try-load k | tee out.txt >/dev/null
  grep -q "LOAD_FAILED: .*parameter 'embed.tok.weight' has shape \[256, 32\] in the checkpoint but \[256, 48\] in the model" out.txt ||
    { cat out.txt; fail "model mismatch not named"; }
  # A grid the checkpoint cannot map onto (saved without stages, loaded with 2).
  run 2 --pp 2 --stage 1 --steps 1 --try-load k | tee out.txt >/dev/null
  grep -q "LOAD_FAILED: .*saved with tp 1 x pp 1; this job runs tp 1 x pp 2" out.txt || { cat out.txt; fail "grid mismatch not named"; }
  echo "damaged shards ok"
  # A folder that cannot be written, even by root (its parent is a file).
  touch afile
  run 2 $common --steps 4 --save afile/ckpt --save-at 2 --out unwritable | tee out.txt >/dev/null
  grep -q "SAVE_FAILED: .*cannot create the checkpoint folder 'afile/ckpt'" out.txt || { cat out.txt; fail "unwritable folder"; }
  diff straight.losses unwritable.losses >/dev/null || fail "a failed save changed training"
  echo "unwritable folder ok"
  # A save that only rank 0 calls ends the job with a clear error (not a hang).
  start=$(date +%s)
  if run 2 $common --steps 4 --save r --save-at 2 --only-rank0-saves --comm-timeout 5 >out.txt 2>&1; then fail "partial save succeeded"; fi
  grep -q "not every rank joined the save" out.txt || { cat out.txt; fail "no clear error for a partial save"; }
  echo "partial save ends in $(( $(date +%s) - start )) s"
  # keep_last: only the newest tags stay.
  run 2 $common --steps 5 --save kl --save-every 1 --keep-last 2 >/dev/null
  [ "$(ls kl | sort | tr '\n' ' ')" = "global_step4 global_step5 latest " ] || fail "keep_last left: $(ls -a kl)"
  # A tag being read is kept: with a shared lock on its manifest.json (as every loading rank
  # holds it) the saves that would prune it keep it, and the next save after the reader let go
  # removes it. Nothing of the locking stays behind.
  flock -s kl/global_step4/manifest.json $mpirun -np 2 "$driver" $common --steps 7 --load kl --save kl --save-every 1 \
    --keep-last 2 >/dev/null
  [ "$(ls kl | sort | tr '\n' ' ')" = "global_step4 global_step6 global_step7 latest " ] || fail "keep_last removed a tag being read: $(ls -a kl)"
  run 2 $common --steps 8 --load kl --save kl --save-every 1 --keep-last 2 >/dev/null
  [ "$(ls -A kl | sort | tr '\n' ' ')" = "global_step7 global_step8 latest " ] || fail "keep_last left: $(ls -A kl)"
  echo "keep_last ok"
  ;;
*) fail "unknown suite $suite" ;;
esac
echo "CHECKPOINT_${suite}_PASSED"
