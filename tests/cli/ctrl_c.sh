#!/usr/bin/env bash
# Ctrl-C during `torchspeed train -n 2` stops after the current step and saves a checkpoint that
# `torchspeed generate` loads. The terminal's Ctrl-C is a SIGINT to the whole foreground process
# group; a new session stands in for the terminal. Usage: ctrl_c.sh TORCHSPEED CONFIG
set -u
ts=$1 config=$2 out=ctrlc_run
rm -rf "$out" ctrlc.log
setsid "$ts" train -c "$config" -n 2 --out "$out" --set train.steps=100000 --set train.log_interval=1 > ctrlc.log 2>&1 &
leader=$!
for _ in $(seq 120); do  # wait until training has logged a few steps (at most 60 s)
  [ -f "$out/metrics.csv" ] && [ "$(wc -l < "$out/metrics.csv")" -ge 4 ] && break
  sleep 0.5
done
kill -INT -- "-$leader"
for _ in $(seq 120); do kill -0 "$leader" 2>/dev/null || break; sleep 0.5; done
if kill -0 "$leader" 2>/dev/null; then echo "still running 60 s after Ctrl-C"; kill -KILL -- "-$leader"; exit 1; fi
wait "$leader"; rc=$?
cat ctrlc.log | tail -4
[ "$rc" = 0 ] || { echo "exit status $rc"; exit 1; }
grep -q "interrupted: saving the checkpoint" ctrlc.log || exit 1
"$ts" generate --checkpoint "$out" --prompt "Ctrl-C " --max-new-tokens 10 --seed 1 && echo "CTRL_C_SAVED"
