"""Compares the loss columns of two metrics.csv files written by `torchspeed train`.

Usage: compare_losses.py A.csv B.csv REL_TOL. Exits non-zero naming the first step that differs.
"""
import csv
import sys


def losses(path):
    with open(path) as f:
        return {int(r["step"]): (float(r["loss"]), r["val_loss"]) for r in csv.DictReader(f)}


a, b, tol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
if set(a) != set(b) or not a:
    sys.exit(f"different logged steps: {sorted(a)} vs {sorted(b)}")
worst = 0.0
for step in sorted(a):
    (la, va), (lb, vb) = a[step], b[step]
    rel = abs(la - lb) / abs(lb)
    worst = max(worst, rel)
    if rel > tol:
        sys.exit(f"step {step}: loss {la} vs {lb} (relative difference {rel:.2e} > {tol})")
    if va and vb and abs(float(va) - float(vb)) / abs(float(vb)) > tol:
        sys.exit(f"step {step}: validation loss {va} vs {vb}")
print(f"losses match over {len(a)} steps: max relative difference {worst:.2e}")
