#!/usr/bin/env python3
"""scripts/bench-tables renders a benchmark's JSON as its tables and puts them into a document.

    bench_tables_test.py SCRIPT SAMPLE_JSON
"""
import os
import subprocess
import sys
import tempfile

script, sample = sys.argv[1], sys.argv[2]
failures = 0


def expect(what, ok):
    global failures
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    failures += 0 if ok else 1


out = subprocess.run([sys.executable, script, sample], stdout=subprocess.PIPE, text=True, check=False)
text = out.stdout
expect("renders with status 0", out.returncode == 0)
expect("the header names date, commit, CPU, cores and features",
       "2026-12-08T01:00:00Z, commit abc1234; Test CPU, 2 cores (avx512f, avx512_bf16, avx2)" in text)
expect("a met target", "| all_reduce 64 MiB vs raw MPI | 2.25 | >= 1 | yes |" in text)
expect("a missed lower-is-better target", "| 1-bit time vs fp32 | 3.5 | <= 1 | NO |" in text)
expect("results with the union of their columns", "| op | bytes | ms | ratio | note |" in text
       and "| all_gather | 4194304 | 0.5 |  | a\\|b |" in text)

with tempfile.TemporaryDirectory() as d:
    doc = os.path.join(d, "bench.md")
    open(doc, "w").write("# Benchmarks\n\nprose before\n\n<!-- bench:comm:begin (x) -->\nold\n<!-- bench:comm:end -->\n\nprose after\n")
    rc = subprocess.run([sys.executable, script, "--update", doc, sample], stdout=subprocess.DEVNULL, check=False).returncode
    once = open(doc).read()
    expect("--update replaces the block and keeps the prose around it",
           rc == 0 and once.startswith("# Benchmarks\n\nprose before\n\n<!-- bench:comm:begin") and
           once.endswith("<!-- bench:comm:end -->\n\nprose after\n") and "old" not in once and "| op |" in once)
    subprocess.run([sys.executable, script, "--update", doc, sample], stdout=subprocess.DEVNULL, check=False)
    expect("a second update changes nothing", open(doc).read() == once)
    bad = os.path.join(d, "bad.json")
    open(bad, "w").write("{\"results\": []}")
    r = subprocess.run([sys.executable, script, bad], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    expect("a file that is not a report is refused by name", r.returncode == 1 and "bad.json" in r.stderr)
sys.exit(1 if failures else 0)
