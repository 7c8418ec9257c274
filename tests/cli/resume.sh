#!/usr/bin/env bash
# `torchspeed train --resume` through the CLI, as a user runs it: 8 steps straight, or 4 steps,
# new processes, --resume to 8. The final models must be byte-identical and the losses of steps
# 5-8 equal (dropout on: the RNG streams must continue too). Then `torchspeed convert` of the
# sharded checkpoint: parsed with Python's standard library only, and `generate` from the
# converted file must give the same text as from the run folder.
set -euo pipefail
ts=$1 cfg=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/ts-resume-XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
sets=(--set train.eval_interval=4 --set train.log_interval=1 --set model.dropout=0.1 --set zero_optimization.stage=2)
"$ts" train -c "$cfg" -n 2 --out a --set train.steps=8 "${sets[@]}" >/dev/null
"$ts" train -c "$cfg" -n 2 --out b --set train.steps=4 "${sets[@]}" >/dev/null
"$ts" train -c "$cfg" -n 2 --out b --set train.steps=8 --resume "${sets[@]}" | tee resume.log | grep "resumed from"
grep -q "resumed from .*b/checkpoints/global_step4 at step 4" resume.log
cmp a/model/model.safetensors b/model/model.safetensors
diff <(cut -d, -f1,3 a/metrics.csv) <(cut -d, -f1,3 b/metrics.csv)
echo "resume ok: models byte-identical, losses of steps 1-8 equal"

"$ts" convert b/checkpoints --to full.safetensors | tee convert.log
python3 - full.safetensors <<'PY'
import json, struct, sys
data = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
meta = header.pop("__metadata__")
assert json.loads(meta["config"])["model"]["d_model"] > 0
end = 0
for name, t in header.items():
    a, b = t["data_offsets"]
    count = 1
    for s in t["shape"]:
        count *= s
    assert t["dtype"] == "F32" and b - a == 4 * count, (name, t)
    end = max(end, b)
assert 8 + n + end == len(data), "trailing or missing bytes"
vals = struct.unpack("<4f", data[8 + n + header["embed.tok.weight"]["data_offsets"][0]:][:16])
assert all(v == v and abs(v) < 10 for v in vals), vals
print("stdlib parse ok:", len(header), "tensors", sorted(header)[:3])
PY
"$ts" generate --checkpoint b --prompt "Resume " --max-new-tokens 40 --seed 5 > from_run.txt
"$ts" generate --checkpoint full.safetensors --prompt "Resume " --max-new-tokens 40 --seed 5 > from_file.txt
"$ts" generate --checkpoint b/checkpoints --prompt "Resume " --max-new-tokens 40 --seed 5 > from_shards.txt
cmp from_run.txt from_file.txt && cmp from_run.txt from_shards.txt
cat from_run.txt
echo "CLI_RESUME_CONVERT_PASSED"
