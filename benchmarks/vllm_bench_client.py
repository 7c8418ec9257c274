#!/usr/bin/env python3
"""vLLM's own benchmark client, `vllm bench serve`, unmodified against `torchspeed serve`.

The common way serving systems are compared: the client sends what it sends to vLLM
(`repetition_penalty`, `stream_options.include_usage`, /tokenize to align prompt lengths) and
parses our server-sent events with its own reader. For each backend (openai: /v1/completions,
openai-chat: /v1/chat/completions) and each number of clients it runs the random dataset and
reads the client's result file; it fails (exit 1) when any request failed, and prints the
client's throughput and latencies beside each.

Needs vLLM's environment (.venv-vllm, from `scripts/serve-peers vllm`) and the model
(`scripts/smollm2`, the default). The tokenizer the client loads is the model's own, written as
a Hugging Face folder by `torchspeed convert --format hf`.

    benchmarks/vllm_bench_client.py [--clients 1,16,64] [--backends openai,openai-chat]
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_healthy(port, proc, timeout=120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torchspeed", default=os.path.join(ROOT, "build", "bin", "torchspeed"))
    ap.add_argument("--model", default=None, help="what serve --checkpoint takes (default: scripts/smollm2)")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--vllm", default=os.path.join(ROOT, ".venv-vllm", "bin", "vllm-peer"))
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument("--backends", default="openai,openai-chat")
    ap.add_argument("--prompts-per-client", type=int, default=2, help="requests = max(8, this x clients)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json", default=None, help="write every run's summary here")
    args = ap.parse_args()

    if not os.access(args.vllm, os.X_OK):
        print(f"vllm_bench_client: {args.vllm} is missing: run scripts/serve-peers vllm first", file=sys.stderr)
        return 2
    model = args.model or subprocess.check_output([os.path.join(ROOT, "scripts", "smollm2")], text=True).strip()
    work = tempfile.mkdtemp(prefix="torchspeed-vllm-bench-")
    hf = os.path.join(work, "hf")
    subprocess.run([args.torchspeed, "convert", model, "--format", "hf", "--to", hf], check=True,
                   stdout=subprocess.DEVNULL)
    clients = [int(c) for c in args.clients.split(",")]
    port = free_port()
    log_path = os.path.join(work, "serve.log")
    cmd = [args.torchspeed, "serve", "--checkpoint", model, "--weights", args.weights, "--host", "127.0.0.1",
           "--port", str(port), "--max-num-seqs", str(max(clients)), "--max-queue", str(4 * max(clients))]
    print("server: " + " ".join(cmd) + f"\nserver log: {log_path}", flush=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_TARGET_DEVICE="cpu",
               TRANSFORMERS_OFFLINE="1")
    runs, failures = [], []
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if not wait_healthy(port, proc):
                print(f"FAIL the server did not become healthy; see {log_path}", flush=True)
                return 1
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as r:
                name = json.load(r)["data"][0]["id"]
            for backend in args.backends.split(","):
                endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
                for c in clients:
                    n = max(8, args.prompts_per_client * c)
                    result = f"{backend}-{c}.json"
                    bench = [args.vllm, "bench", "serve", "--backend", backend, "--endpoint", endpoint,
                             "--base-url", f"http://127.0.0.1:{port}", "--model", name, "--tokenizer", hf,
                             "--dataset-name", "random", "--random-input-len", str(args.input_len),
                             "--random-output-len", str(args.output_len), "--num-prompts", str(n),
                             "--max-concurrency", str(c), "--save-result", "--result-dir", work,
                             "--result-filename", result, "--disable-tqdm"]
                    t0 = time.monotonic()
                    out = subprocess.run(bench, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         timeout=900)
                    path = os.path.join(work, result)
                    if out.returncode != 0 or not os.path.exists(path):
                        failures.append(f"{backend} {c} clients: vllm bench serve exited {out.returncode}")
                        print(out.stdout[-3000:], flush=True)
                        continue
                    with open(path) as f:
                        d = json.load(f)
                    row = {"backend": backend, "clients": c, "requests": n, "completed": d["completed"],
                           "failed": d["failed"], "output_tok_s": round(d["output_throughput"], 1),
                           "ttft_p50_ms": round(d["median_ttft_ms"], 1), "ttft_p99_ms": round(d["p99_ttft_ms"], 1),
                           "tpot_p50_ms": round(d["median_tpot_ms"], 1), "seconds": round(time.monotonic() - t0, 1)}
                    runs.append(row)
                    print(f"vllm bench serve --backend {backend:11s} {c:3d} clients: {d['completed']}/{n} completed, "
                          f"{d['failed']} failed, {row['output_tok_s']} output tok/s, TTFT p50 {row['ttft_p50_ms']} ms "
                          f"p99 {row['ttft_p99_ms']} ms, TPOT p50 {row['tpot_p50_ms']} ms", flush=True)
                    if d["failed"] != 0 or d["completed"] != n:
                        failures.append(f"{backend} {c} clients: {d['failed']} of {n} requests failed")
                        for e in [e for e in d.get("errors", []) if e][:3]:
                            print(f"  error: {e[:300]}", flush=True)
                    if "WARNING: /tokenize unavailable" in out.stdout:
                        failures.append(f"{backend} {c} clients: the client found no /tokenize")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    summary = {"cpu": cpu_name(), "model": os.path.basename(model), "weights": args.weights,
               "input_len": args.input_len, "output_len": args.output_len, "runs": runs, "failures": failures}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    for f in failures:
        print(f"FAIL {f}", flush=True)
    print(f"vllm bench serve against torchspeed serve on {summary['cpu']}: {len(runs)} runs, "
          f"{len(failures)} failures", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
