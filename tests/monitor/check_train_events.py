"""Checks the DeepSpeed monitor events `torchspeed train` wrote against its own metrics.csv.

Usage: check_train_events.py EVENTS_DIR METRICS_CSV TRAIN_BATCH_SIZE

EVENTS_DIR (tensorboard.output_path/job_name, where csv_monitor also wrote) is read with
TensorBoard's EventAccumulator, the loader TensorBoard's UI uses: Train/Samples/train_loss and
Train/Samples/lr must have one point per training step at step = steps x train_batch_size,
with the loss that metrics.csv (written by the training loop, not by the monitor) records for
that step and the lr it records for the next (DeepSpeed logs the lr after the scheduler's
step), to float32 precision. The csv_monitor files must hold the same points.
Prints "check_train_events: all N checks passed", or "FAIL ..." lines and exits 1.
"""
import csv
import glob
import os
import struct
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

events_dir, metrics_path, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
checks = failures = 0


def check(cond, what):
    global checks, failures
    checks += 1
    if not cond:
        failures += 1
        print("FAIL " + what)


def close(a, b):
    return abs(a - b) <= 1e-6 * max(abs(b), 1e-30)


with open(metrics_path) as f:
    rows = {int(r["step"]): r for r in csv.DictReader(f)}
check(len(rows) > 1, f"metrics.csv has {len(rows)} rows")
files = glob.glob(os.path.join(events_dir, "events.out.tfevents.*"))
check(len(files) == 1, f"one event file in {events_dir}, found {files}")
acc = EventAccumulator(events_dir)
acc.Reload()
tags = acc.Tags()["scalars"]
for tag, column in (("Train/Samples/train_loss", "loss"), ("Train/Samples/lr", "lr")):
    check(tag in tags, f"tag {tag} in {tags}")
    if tag not in tags:
        continue
    points = {e.step: e.value for e in acc.Scalars(tag)}
    check(sorted(points) == [s * batch for s in sorted(rows)],
          f"{tag}: steps {sorted(points)} are the training steps x {batch}")
    with open(os.path.join(events_dir, tag.replace("/", "_") + ".csv")) as f:
        csv_points = {int(r[0]): float(r[1]) for r in list(csv.reader(f))[1:]}
    for step, r in rows.items():
        # DeepSpeed writes the lr after the scheduler's step: the lr the next step uses, which
        # is what metrics.csv records for that step.
        if column == "lr":
            if step + 1 not in rows:
                continue
            r = rows[step + 1]
        want = float(r[column])
        got = points.get(step * batch)
        check(got is not None and close(got, struct.unpack("f", struct.pack("f", want))[0]),
              f"{tag} at step {step}: event {got}, metrics.csv {want}")
        check(step * batch in csv_points and close(csv_points[step * batch], want),
              f"{tag} csv at step {step}: {csv_points.get(step * batch)}, metrics.csv {want}")
if failures:
    sys.exit(1)
print(f"check_train_events: all {checks} checks passed")
