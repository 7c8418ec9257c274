#!/usr/bin/env python3
"""What serving LoRA adapters costs: decode throughput of `torchspeed serve` on SmolLM2-135M
(the GGUF file, its own Q4_1 weights) for the base model and with adapters, side by side in one
run on one server.

Two adapters of rank 16 on all seven linears of every block (made by PEFT with random A and B on
the model exported as a Hugging Face folder by `torchspeed convert --format hf`) are loaded with
--lora-modules. Cases, alternated round by round (the machine's speed drifts), each the median of
--rounds rounds:
  1 client:  one greedy request of --tokens tokens (ignore_eos) for the base, then adapter a;
  8 clients: 8 such requests at once for the base, for adapter a, and mixed (4 base, 2 a, 2 b:
             three models in every forward pass).
Prints tokens/s and each adapter case's ratio to the base case beside it.

Needs the bench environment (scripts/bench-env: transformers and peft); run with its python:
    .venv-bench/bin/python benchmarks/lora_serve.py [--rounds 3] [--tokens 64] [--json FILE]
"""
import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from vllm_bench_client import free_port, wait_healthy  # noqa: E402


def cpu_name():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def make_adapters(hf_dir, out_dir):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {}
    for i, name in enumerate(("a", "b")):
        torch.manual_seed(10 + i)
        base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        cfg = LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
        pm = get_peft_model(base, cfg)
        with torch.no_grad():  # small updates: the text stays text, the work is the same
            for k, p in pm.named_parameters():
                if "lora_B" in k:
                    p.mul_(0.01)
        paths[name] = os.path.join(out_dir, "adapter-" + name)
        pm.save_pretrained(paths[name])
    return paths


def post(port, body):
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def run_case(port, models, tokens):
    """Generated tokens per second over the requests of `models`, sent at once."""
    body = lambda m: {"model": m, "prompt": "The history of the river", "max_tokens": tokens, "temperature": 0,
                      "ignore_eos": True}
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(models)) as ex:
        results = list(ex.map(lambda m: post(port, body(m)), models))
    dt = time.perf_counter() - t0
    n = sum(r["usage"]["completion_tokens"] for r in results)
    return n / dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    cli = os.path.join(ROOT, "build", "bin", "torchspeed")
    gguf = subprocess.check_output([os.path.join(ROOT, "scripts", "smollm2")], text=True).strip()
    with tempfile.TemporaryDirectory() as tmp:
        hf = os.path.join(tmp, "hf")
        subprocess.check_call([cli, "convert", gguf, "--format", "hf", "--to", hf], stdout=subprocess.DEVNULL)
        adapters = make_adapters(hf, tmp)
        port = free_port()
        cmd = [cli, "serve", "--checkpoint", gguf, "--port", str(port), "--served-model-name", "base"]
        for k, p in adapters.items():
            cmd += ["--lora-modules", "%s=%s" % (k, p)]
        log = open(os.path.join(tmp, "serve.log"), "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if not wait_healthy(port, proc):
                log.close()
                sys.exit("the server did not start: " + open(log.name).read()[-2000:])
            cases = [("1 client", "base", ["base"]), ("1 client", "adapter a", ["a"]),
                     ("8 clients", "base", ["base"] * 8), ("8 clients", "adapter a", ["a"] * 8),
                     ("8 clients", "mixed base/a/b", ["base"] * 4 + ["a"] * 2 + ["b"] * 2)]
            run_case(port, ["base", "a", "b"], 8)  # warm-up
            rates = {(g, n): [] for g, n, _ in cases}
            for _ in range(args.rounds):
                for g, n, models in cases:
                    rates[(g, n)].append(run_case(port, models, args.tokens))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print("LoRA serving, SmolLM2-135M Q4_1 (GGUF), 2 adapters r 16 on all 7 linears; CPU: %s, %d cores; "
          "median of %d rounds, %d tokens per request" % (cpu_name(), os.cpu_count(), args.rounds, args.tokens))
    out = []
    for g, n, _ in cases:
        base = med[(g, "base")]
        ratio = med[(g, n)] / base
        print("  %-9s %-15s %7.1f tok/s   x%.2f of the base" % (g, n, med[(g, n)], ratio))
        out.append({"clients": g, "case": n, "tokens_per_s": med[(g, n)], "ratio_to_base": ratio, "rounds": rates[(g, n)]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "results": out}, f, indent=2)


if __name__ == "__main__":
    main()
