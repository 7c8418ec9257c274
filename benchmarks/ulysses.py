"""Sequence parallelism's benchmark (issue 39): DeepSpeed-Ulysses in torchspeed beside DeepSpeed's.

Part 1, the longest sequence that trains within a memory budget per rank, at sequence_parallel_size
1, 2 and 4 (4 ranks share this machine's cores: memory, not speed, is measured), with and without
ALST's tiling (torchspeed.tiled_mlp, tiled_loss). For each sp the sequence doubles from 512 x sp
until a run's peak passes the budget. A run is `torchspeed train` as an autotuning experiment (a few
timed steps; the peak of LibTorch's CPU allocations on the rank that holds the most, counted from
before the model exists). Beside each peak: `torchspeed plan`'s prediction for that layout (its
formula, plan/plan.h's Note [Plan model]). The model is plan's GPT shape (learned positions,
LayerNorm, GELU, tied head) with a 4096-token vocabulary, so the logits weigh as in real models.

Part 2, tokens per second on one Llama shape (RoPE, RMSNorm, SwiGLU, 8 heads, 2 KV heads) and
sequence, at sp 1 and 2: torchspeed against DeepSpeed 0.19.8's Ulysses for Hugging Face
(benchmarks/peers_ulysses.py: UlyssesSPAttentionHF + UlyssesSPDataLoaderAdapter on transformers'
LlamaForCausalLM, gloo), both at ZeRO stage 1 with AdamW, one intra-op thread per rank (sp 1 as
well, so the two compare on one core), rounds alternating the order, medians. DeepSpeed's ZeRO-1/2
scale Ulysses' gradients by sp (its issue #5248; peers_ulysses.py's docstring): that changes no
step time. Run with scripts/bench-env's Python:

  .venv-bench/bin/python benchmarks/ulysses.py [--budget-mb 192] [--rounds 3] [--seq 4096]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.join(ROOT, "build", "bin", "torchspeed")
PEER = os.path.join(ROOT, "benchmarks", "peers_ulysses.py")


def train_config(model, seq, sp, stage, tiled, metric_path, threads=0):
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage},
        "sequence_parallel_size": sp,
        "model": dict(model, seq_len=seq, dropout=0.0),
        "data": {"seq_len": seq, "val_fraction": 0.1},
        "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 3, "metric_path": metric_path},
        "train": {"steps": 100, "eval_interval": 100000, "log_interval": 1, "checkpoint_interval": 0},
        "torchspeed": {"intra_op_threads": threads},
    }
    if tiled:
        cfg["torchspeed"].update({"tiled_mlp": max(2, seq // sp // model["d_model"]), "tiled_loss": 8})
    return cfg


def run_ours(work, name, cfg, ranks):
    path = os.path.join(work, name + ".json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    out = os.path.join(work, "run-" + name)
    log = os.path.join(work, name + ".log")
    with open(log, "w") as f:
        rc = subprocess.call([CLI, "train", "-c", path, "-n", str(ranks), "--out", out], stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        tail = open(log).read().strip().splitlines()[-3:]
        return {"error": "torchspeed train exited %d: %s" % (rc, " | ".join(tail))}
    return json.load(open(cfg["autotuning"]["metric_path"]))


def predicted(work, name, cfg, sp):
    """torchspeed plan's peak per rank for this config at dp = sp, sp."""
    cluster = os.path.join(work, "cluster.json")
    with open(cluster, "w") as f:
        json.dump({"devices_per_node": sp, "memory": 1e12, "peak_flops": 1e11, "optimizer_rate": 1e8,
                   "intra": {"bandwidth": 1e9, "latency": 1e-5}}, f)
    cfg = dict(cfg, train_batch_size=1)
    path = os.path.join(work, name + ".plan-config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    out = os.path.join(work, name + ".plan.json")
    subprocess.check_call([CLI, "plan", "--cluster", cluster, "--config", path, "--layout",
                           "dp=%d,tp=1,pp=1,sp=%d,zero=%d,micro=1,ckpt=0" % (sp, sp, cfg["zero_optimization"]["stage"]),
                           "--json", out], stdout=subprocess.DEVNULL)
    est = json.load(open(out))["estimates"][0]
    return est["memory"]["total"], est["a2a_bytes"]


def part1(args, work):
    model = {"vocab": 4096, "d_model": 128, "n_layer": 2, "n_head": 4}
    budget = args.budget_mb * 2**20
    print("\n## Longest sequence within %d MiB per rank (GPT shape: %s; ZeRO-1, fp32, micro-batch 1)\n"
          % (args.budget_mb, ", ".join("%s %s" % kv for kv in model.items())))
    print("| sp | tiled | seq | peak MiB (measured, max over ranks) | plan's formula MiB | plan / measured | a2a MB/step (plan) | tokens/s | fits |")
    print("|---|---|---|---|---|---|---|---|---|")
    longest = {}
    for sp in args.sps:
        for tiled in (False, True):
            seq = 512 * sp
            best = 0
            while seq <= args.max_seq:
                name = "p1_sp%d_%s_%d" % (sp, "t" if tiled else "u", seq)
                cfg = train_config(model, seq, sp, 1, tiled, os.path.join(work, name + ".metrics.json"))
                r = run_ours(work, name, cfg, sp)
                if "error" in r:
                    print("| %d | %s | %d | error: %s | | | | | |" % (sp, "yes" if tiled else "no", seq, r["error"]))
                    break
                peak = r["peak_allocated_bytes"]
                plan_bytes, a2a = predicted(work, name, cfg, sp)
                fits = peak <= budget
                print("| %d | %s | %d | %.1f | %.1f | %.2f | %.1f | %.0f | %s |" % (
                    sp, "yes" if tiled else "no", seq, peak / 2**20, plan_bytes / 2**20, plan_bytes / peak, a2a / 1e6,
                    r["throughput"] * seq, "yes" if fits else "no"))
                sys.stdout.flush()
                if not fits:
                    break
                best = seq
                seq *= 2
            longest[(sp, tiled)] = best
    print("\nLongest sequence that trained within %d MiB:" % args.budget_mb)
    for (sp, tiled), seq in sorted(longest.items()):
        base = longest.get((1, tiled)) or 0
        print("  sp %d, %s: %d tokens%s" % (sp, "tiled MLP and loss" if tiled else "untiled", seq,
                                          " (%.1fx sp 1's)" % (seq / base) if base else ""))


def part2(args, work):
    llama = {"vocab": 4096, "d_model": 256, "n_layer": 2, "n_head": 8, "n_kv_head": 2, "d_ff": 688,
             "positions": "rope", "norm": "rmsnorm", "activation": "swiglu", "qkv_bias": False,
             "attn_out_bias": False, "mlp_bias": False, "tie_embeddings": False}
    seq = args.seq
    print("\n## Tokens/s, Llama shape (%s), seq %d, ZeRO-1, fp32, one thread per rank\n"
          % (", ".join("%s %s" % (k, v) for k, v in llama.items() if k in ("d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "vocab")), seq))
    results = {}
    for rnd in range(args.rounds):
        order = ["ours", "deepspeed"] if rnd % 2 == 0 else ["deepspeed", "ours"]
        for sp in (1, 2):
            for impl in order:
                if impl == "ours":
                    name = "p2_sp%d_r%d" % (sp, rnd)
                    cfg = train_config(llama, seq, sp, 1, False, os.path.join(work, name + ".metrics.json"), threads=1)
                    r = run_ours(work, name, cfg, sp)
                    tps = r["throughput"] * seq if "error" not in r else None
                else:
                    cmd = [sys.executable, PEER, "--nproc", str(sp), "--sp", str(sp), "--seq", str(seq), "--stage", "1",
                           "--vocab", str(llama["vocab"]), "--d_model", str(llama["d_model"]), "--n_layer", str(llama["n_layer"]),
                           "--n_head", str(llama["n_head"]), "--n_kv_head", str(llama["n_kv_head"]), "--d_ff", str(llama["d_ff"]),
                           "--warmup", "1", "--steps", "3"]
                    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
                    r = json.loads(lines[-1]) if lines else {"error": "no output from peers_ulysses.py (exit %d)" % p.returncode}
                    tps = r.get("tokens_per_s")
                key = (impl, sp)
                results.setdefault(key, [])
                if tps is None:
                    results[key].append(None)
                    print("  %s sp %d: error: %s" % (impl, sp, r.get("error")))
                else:
                    results[key].append(tps)
                sys.stdout.flush()
    print("| sp | torchspeed tokens/s | DeepSpeed-Ulysses tokens/s | torchspeed / DeepSpeed |")
    print("|---|---|---|---|")
    for sp in (1, 2):
        ours = [x for x in results[("ours", sp)] if x]
        ds = [x for x in results[("deepspeed", sp)] if x]
        mo = statistics.median(ours) if ours else float("nan")
        md = statistics.median(ds) if ds else float("nan")
        print("| %d | %.0f | %.0f | %.2fx |" % (sp, mo, md, mo / md if ds and ours else float("nan")))
    print("(medians of %d rounds; each run: 1 warm-up step, 2-3 timed)" % args.rounds)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mb", type=int, default=192, help="memory budget per rank, MiB (part 1)")
    ap.add_argument("--max-seq", type=int, default=65536, help="stop doubling past this sequence (part 1)")
    ap.add_argument("--sp", dest="sps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq", type=int, default=4096, help="part 2's sequence")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--part", type=int, choices=[0, 1, 2], default=0, help="0: both")
    args = ap.parse_args()
    if not os.path.exists(CLI):
        sys.exit("build torchspeed first (scripts/setup): %s is missing" % CLI)
    env = subprocess.run([CLI, "env"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
    cpu = next((" ".join(l.split()[1:]) for l in env.splitlines() if l.startswith("cpu")), "unknown CPU")
    print("# torchspeed bench: sequence parallelism (Ulysses) and ALST tiling; %s, %d cores" % (cpu, os.cpu_count()))
    with tempfile.TemporaryDirectory(prefix="torchspeed_ulysses_") as work:
        if args.part in (0, 1):
            part1(args, work)
        if args.part in (0, 2):
            part2(args, work)


if __name__ == "__main__":
    main()
