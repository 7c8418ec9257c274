"""Compares the loss columns of two metrics.csv files written by `torchspeed train`.

Usage: compare_losses.py A.csv B.csv REL_TOL [--grad-norm]. Exits non-zero naming the first step
that differs. --grad-norm compares the gradient norms (before clipping) too.
"""
import csv
import sys


def rows(path):
    with open(path) as f:
        return {int(r["step"]): r for r in csv.DictReader(f)}


args = [x for x in sys.argv[1:] if x != "--grad-norm"]
with_norm = "--grad-norm" in sys.argv[1:]
a, b, tol = rows(args[0]), rows(args[1]), float(args[2])
if set(a) != set(b) or not a:
    sys.exit(f"different logged steps: {sorted(a)} vs {sorted(b)}")
worst = 0.0
columns = ["loss", "val_loss"] + (["grad_norm"] if with_norm else [])
for step in sorted(a):
    for col in columns:
        va, vb = a[step][col], b[step][col]
        if not va or not vb:
            if col != "val_loss" and (va or vb):
                sys.exit(f"step {step}: {col} missing in one file")
            if bool(va) != bool(vb):
                sys.exit(f"step {step}: validation loss in one file only")
            continue
        rel = abs(float(va) - float(vb)) / abs(float(vb))
        worst = max(worst, rel)
        if rel > tol:
            sys.exit(f"step {step}: {col} {va} vs {vb} (relative difference {rel:.2e} > {tol})")
print(f"losses match over {len(a)} steps ({', '.join(columns)}): max relative difference {worst:.2e}")
