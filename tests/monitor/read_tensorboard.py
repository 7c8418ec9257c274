"""Reads torchspeed's DeepSpeed-monitor output with the real Python tools.

DIR is what `TS_MONITOR_OUT=DIR unit_ds_monitor --gtest_filter=DsMonitor.WritesForPythonReader`
wrote: DIR/DeepSpeedJobName/ with one TensorBoard event file and the CSV files, and
DIR/expected.txt with one "name<TAB>step<TAB>value as a C99 hex float" line per event.

- The event file goes through tensorboard's EventAccumulator (what TensorBoard's UI loads): the
  scalar tags, steps and float32 values must be the events'. Its records are also framed and
  checked with tensorboard's own masked_crc32c, and its first event must be the file version.
- The CSV files must be byte-for-byte what DeepSpeed's csvMonitor.write_events (its code copied
  below from deepspeed/monitor/csv_monitor.py) writes for the same events.

Prints "read_tensorboard: all N checks passed", or "FAIL ..." lines and exits 1.
"""

import csv
import math
import os
import re
import socket
import struct
import sys
import tempfile

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

checks = 0
failures = 0


def check(cond, what):
    global checks, failures
    checks += 1
    if not cond:
        failures += 1
        print("FAIL " + what)


def f32(v):
    return struct.unpack("<f", struct.pack("<f", v))[0]


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))


def read_expected(path):
    events = []
    with open(path) as f:
        for line in f:
            name, step, value = line.rstrip("\n").split("\t")
            events.append((name, float.fromhex(value), int(step)))
    return events


def records(path):
    """The TFRecord payloads of `path`, each CRC checked with tensorboard's masked_crc32c."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    at = 0
    while at < len(data):
        header = data[at:at + 8]
        (n,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", data[at + 8:at + 12])
        check(hcrc == masked_crc32c(header), f"length crc of the record at byte {at}")
        payload = data[at + 12:at + 12 + n]
        (dcrc,) = struct.unpack("<I", data[at + 12 + n:at + 16 + n])
        check(dcrc == masked_crc32c(payload), f"data crc of the record at byte {at}")
        out.append(payload)
        at += 16 + n
    check(at == len(data), "the file ends at a record boundary")
    return out


def deepspeed_csv(log_dir, event_list, filenames):
    """deepspeed/monitor/csv_monitor.py csvMonitor.write_events, its rank check left out."""
    for event in event_list:
        log_name = event[0]
        value = event[1]
        step = event[2]
        if '/' in log_name:
            record_splits = log_name.split('/')
            header = record_splits[len(record_splits) - 1]
        else:
            header = log_name
        filename = log_name.replace('/', '_').replace(' ', '_')
        fname = log_dir + '/' + filename + '.csv'
        with open(fname, 'a+') as csv_monitor_file:
            csv_monitor_writer = csv.writer(csv_monitor_file)
            if filename not in filenames:
                filenames.append(filename)
                csv_monitor_writer.writerow(['step', header])
            csv_monitor_writer.writerow([step, value])


def main():
    out = sys.argv[1]
    log_dir = os.path.join(out, "DeepSpeedJobName")
    events = read_expected(os.path.join(out, "expected.txt"))
    check(len(events) > 0, "expected.txt lists events")

    # The event file: name, framing, first record.
    names = [n for n in os.listdir(log_dir) if n.startswith("events.out.tfevents.")]
    check(len(names) == 1, f"one event file in {log_dir}, found {names}")
    m = re.fullmatch(r"events\.out\.tfevents\.(\d{10})\.(.+)\.(\d+)\.(\d+)", names[0])
    check(m is not None and m.group(2) == socket.gethostname(),
          f"event file name {names[0]} is SummaryWriter's, with host {socket.gethostname()}")
    payloads = records(os.path.join(log_dir, names[0]))
    check(len(payloads) == len(events) + 1, f"{len(events) + 1} records, found {len(payloads)}")
    first = event_pb2.Event.FromString(payloads[0])
    check(first.file_version == "brain.Event:2", f"first event is the file version: {first}")

    # TensorBoard's loader.
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    want = {}
    for name, value, step in events:
        want.setdefault(name, []).append((step, f32(value)))
    tags = sorted(acc.Tags()["scalars"])
    check(tags == sorted(want), f"scalar tags {tags} == {sorted(want)}")
    for tag in sorted(want):
        got = [(s.step, s.value) for s in acc.Scalars(tag)] if tag in tags else []
        check(len(got) == len(want[tag]), f"{tag}: {len(want[tag])} scalars, got {len(got)}")
        for (gs, gv), (ws, wv) in zip(got, want[tag]):
            check(gs == ws and same(gv, wv), f"{tag}: (step {gs}, {gv!r}) == (step {ws}, {wv!r})")
        walls = [s.wall_time for s in acc.Scalars(tag)] if tag in tags else []
        check(all(abs(w - first.wall_time) < 600 for w in walls), f"{tag}: wall times near the file's")

    # The CSV files against DeepSpeed's own code.
    ours = sorted(n for n in os.listdir(log_dir) if n.endswith(".csv"))
    with tempfile.TemporaryDirectory() as ref_dir:
        deepspeed_csv(ref_dir, events, [])
        theirs = sorted(os.listdir(ref_dir))
        check(ours == theirs, f"CSV files {ours} == DeepSpeed's {theirs}")
        for n in theirs:
            with open(os.path.join(ref_dir, n), "rb") as f:
                ref = f.read()
            path = os.path.join(log_dir, n)
            got = open(path, "rb").read() if os.path.exists(path) else b""
            check(got == ref, f"{n}: our bytes {got[:200]!r} == DeepSpeed's {ref[:200]!r}")

    if failures:
        print(f"read_tensorboard: {failures} of {checks} checks failed")
        sys.exit(1)
    print(f"read_tensorboard: all {checks} checks passed "
          f"({len(events)} scalars in {len(tags)} tags, {len(ours)} CSV files)")


if __name__ == "__main__":
    main()
