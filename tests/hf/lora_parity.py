#!/usr/bin/env python3
"""LoRA adapters (PEFT's format) against PEFT itself on transformers' models.

  lora_parity.py make ROOT
      ROOT/tokenizer and ROOT/<base> (families_parity's Qwen2 and SmolLM2 shapes, random weights),
      and for each base two adapters made by PEFT (get_peft_model + save_pretrained) with random
      A and B (init_lora_weights=False, so that B is not zero): ROOT/<base>-qv (q_proj and v_proj,
      r 4, alpha 8) and ROOT/<base>-all (all seven linears, r 8, alpha 16, use_rslora, down_proj
      at rank 4 by rank_pattern).
  lora_parity.py serve BASE --cli TORCHSPEED [--tol T] [--tp N]
      `torchspeed serve` on BASE with both adapters (--lora-modules): three requests at once, one
      per model (the base and each adapter, batched together), with echo and logprobs and 16
      greedy tokens: each one's log-probabilities within T (1e-4) of PEFT's model for that
      adapter and its tokens equal to PEFT's greedy ones; each again alone gives the same
      tokens; /v1/models lists the adapters with the base as parent; an unknown model is 404
      and an adapter on /v1/embeddings 400. --tp N: the server on N tensor-parallel ranks.
  lora_parity.py refuse BASE --cli TORCHSPEED
      adapters we do not compute (DoRA, a LoRA bias, modules_to_save, a target outside the
      blocks) make `serve` exit non-zero with an error naming the key or tensor.
  lora_parity.py peft BASE ADAPTER OURS [--tol T]
      ADAPTER (e.g. one `torchspeed train` exported) loads with PeftModel.from_pretrained on BASE,
      its tensors exactly PEFT's LoRA parameters, and its logits on OURS "ids" equal OURS "train"
      and "serve" (gpt2_logits of the model with the adapter merged) within T.
Each check prints a line; failures print "FAIL ..." and exit 1.
"""
import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402
import families_parity as fp  # noqa: E402

BASES = ("qwen2", "smollm2")


def adapter_configs():
    from peft import LoraConfig

    return {
        "qv": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                         init_lora_weights=False, task_type="CAUSAL_LM"),
        "all": LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"],
                          rank_pattern={"down_proj": 4}, use_rslora=True, lora_dropout=0.0, init_lora_weights=False,
                          task_type="CAUSAL_LM"),
    }


def make(args):
    from peft import get_peft_model
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoModelForCausalLM

    os.makedirs(args.root, exist_ok=True)
    tdir = os.path.join(args.root, "tokenizer")
    os.makedirs(tdir, exist_ok=True)
    tok = ByteLevelBPETokenizer()
    tok.train(fp.corpus_files(), vocab_size=fp.VOCAB, min_frequency=2, show_progress=False)
    tok.save(os.path.join(tdir, "tokenizer.json"))
    with open(os.path.join(fp.FORTUNES, "fortunes"), encoding="utf-8", errors="replace") as f:
        text = f.read()[:400]
    with open(os.path.join(args.root, "text.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(text)
    configs = fp.family_configs()
    for i, name in enumerate(BASES):
        torch.manual_seed(200 + i)
        model = AutoModelForCausalLM.from_config(configs[name], torch_dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        d = os.path.join(args.root, name)
        model.save_pretrained(d)
        shutil.copy(os.path.join(tdir, "tokenizer.json"), os.path.join(d, "tokenizer.json"))
        for j, (kind, cfg) in enumerate(adapter_configs().items()):
            torch.manual_seed(300 + 10 * i + j)
            base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
            pm = get_peft_model(base, cfg)
            out = os.path.join(args.root, "%s-%s" % (name, kind))
            pm.save_pretrained(out)
            n = sum(p.numel() for k, p in pm.named_parameters() if "lora_" in k)
            print("lora_parity make: %s: %s, %d LoRA parameters" % (out, cfg.target_modules, n), flush=True)


def reference(base, adapter):
    """PEFT's model: the base from transformers with the adapter (None: the base alone)."""
    from peft import PeftModel

    model = fp.load_reference(base)
    if adapter is None:
        return model
    pm = PeftModel.from_pretrained(model, adapter)
    pm.eval()
    return pm


def start_server(cli, base, extra, log_name):
    port = fp.free_port()
    log = open(log_name, "w")
    cmd = [cli, "serve", "--checkpoint", base, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m"] + extra
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            log.close()
            return proc, None, open(log_name).read()
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=5) as r:
                if r.status == 200:
                    return proc, port, log
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            return proc, None, "the server did not turn healthy in 120 s"
        time.sleep(0.25)


def stop_server(proc, log):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        check(False, "the server did not stop within 30 s of SIGTERM")
    if hasattr(log, "close"):
        log.close()


def status_of(port, path, body):
    try:
        fp.post(port, path, body)
        return 200, ""
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def serve(args):
    base = args.base
    root = os.path.dirname(os.path.abspath(base))
    name = os.path.basename(os.path.abspath(base))
    adapters = {"qv": os.path.join(root, name + "-qv"), "all": os.path.join(root, name + "-all")}
    tok = fp.HFTokenizer(base)
    with open(os.path.join(root, "text.txt"), encoding="utf-8") as f:
        prompt_ids = tok.encode(f.read())[:32]
    new = 16
    ref = {}
    for model_id, adir in [("m", None)] + list(adapters.items()):
        model = reference(base, adir)
        with torch.no_grad():
            x = torch.tensor([prompt_ids])
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)[0].tolist()
            logp = torch.log_softmax(model(input_ids=torch.tensor([out])).logits[0].double(), -1)
        ref[model_id] = (out, [logp[i - 1, out[i]].item() for i in range(1, len(out))])
    # Each adapter must move the log-probabilities well past the tolerance, or the check is weak.
    for k in adapters:
        moved = max(abs(a - b) for a, b in zip(ref[k][1][:len(prompt_ids) - 1], ref["m"][1][:len(prompt_ids) - 1]))
        print("lora_parity: %s: adapter %s moves the prompt's log-probabilities by up to %.3g" % (base, k, moved), flush=True)
        check(moved > 100 * args.tol, "%s: adapter %s changes the log-probabilities by only %g" % (base, k, moved))

    extra = ["-n", str(args.tp), "--tp", str(args.tp)] if args.tp > 1 else []
    for k, d in adapters.items():
        extra += ["--lora-modules", "%s=%s" % (k, d)]
    proc, port, log = start_server(args.cli, base, extra, name + ".lora-serve.log")
    if port is None:
        check(False, "%s: the server did not start: %s" % (base, log[-2000:]))
        return
    try:
        models = fp_get(port, "/v1/models")
        ids = {m["id"]: m for m in models["data"]}
        check(set(ids) == {"m", "qv", "all"} and ids["qv"]["parent"] == "m" and ids["qv"]["root"] == adapters["qv"],
              "/v1/models lists %s" % json.dumps(models["data"]))

        def ask(model_id):
            return fp.post(port, "/v1/completions", {"model": model_id, "prompt": prompt_ids, "max_tokens": new,
                                                     "temperature": 0, "echo": True, "logprobs": 0})

        # The three at once: the engine batches sequences of different adapters into one forward.
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            together = dict(zip(["m", "qv", "all"], ex.map(ask, ["m", "qv", "all"])))
        for model_id, r in together.items():
            check(r["model"] == model_id, "the answer names model %r, asked %r" % (r["model"], model_id))
            choice = r["choices"][0]
            lps = choice["logprobs"]["token_logprobs"]
            out, ref_lp = ref[model_id]
            check(len(lps) == len(out), "%s: %d logprobs, want %d" % (model_id, len(lps), len(out)))
            diff = max(abs(a - b) for a, b in zip(lps[1:], ref_lp))
            same = choice["text"] == tok.decode(out)
            print("lora_parity: %s model %s (batched with the others): %d prompt + %d greedy tokens equal to PEFT's: %s; "
                  "max |logprob difference| %.3g" % (base, model_id, len(prompt_ids), new, same, diff), flush=True)
            check(same, "%s: %s: greedy text %r, PEFT's %r" % (base, model_id, choice["text"][-120:], tok.decode(out)[-120:]))
            check(diff <= args.tol, "%s: %s: log-probabilities differ from PEFT's by %g > %g" % (base, model_id, diff, args.tol))
        for model_id in ("qv", "all"):
            alone = ask(model_id)["choices"][0]["text"]
            check(alone == together[model_id]["choices"][0]["text"],
                  "%s: adapter %s alone gives other tokens than batched" % (base, model_id))
        code, body = status_of(port, "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 1})
        check(code == 404 and "qv" in body, "an unknown model: %d %s" % (code, body[:300]))
        code, body = status_of(port, "/v1/embeddings", {"model": "qv", "input": "x"})
        check(code == 400 and "LoRA adapter" in body, "an adapter on /v1/embeddings: %d %s" % (code, body[:300]))
        r = fp.post(port, "/v1/chat/completions", {"model": "all", "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 4, "temperature": 0})
        check(r["model"] == "all" and r["usage"]["completion_tokens"] >= 1, "chat with an adapter: %s" % json.dumps(r)[:300])
    finally:
        stop_server(proc, log)


def fp_get(port, path):
    with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=60) as r:
        return json.loads(r.read())


def refuse(args):
    base = args.base
    root = os.path.dirname(os.path.abspath(base))
    name = os.path.basename(os.path.abspath(base))
    good = os.path.join(root, name + "-qv")
    cases = [("use_dora", {"use_dora": True}), ("bias", {"bias": "all"}), ("modules_to_save", {"modules_to_save": ["lm_head"]}),
             ("target_modules", {"target_modules": ["embed_tokens"]}), ("r", {"r": 0})]
    for key, change in cases:
        d = os.path.join(root, "bad-" + key)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(good, d)
        cfg = json.load(open(os.path.join(d, "adapter_config.json")))
        cfg.update(change)
        json.dump(cfg, open(os.path.join(d, "adapter_config.json"), "w"))
        proc, port, out = start_server(args.cli, base, ["--lora-modules", "bad=" + d], name + ".refuse.log")
        if port is not None:
            stop_server(proc, out)
            check(False, "%s: the server started with an adapter setting %s" % (base, change))
            continue
        ok = proc.returncode != 0 and ('"%s"' % key) in out and "bad" in out
        print("lora_parity: adapter with %s: exit %s, %s" % (json.dumps(change), proc.returncode,
                                                           (out.strip().splitlines() or [""])[-1][:200]), flush=True)
        check(ok, "%s: an adapter with %s: exit %s, output %s" % (base, change, proc.returncode, out[-600:]))


def peft_logits(args):
    from safetensors.torch import load_file

    from peft import PeftModel

    model = fp.load_reference(args.base)
    pm = PeftModel.from_pretrained(model, args.adapter)
    pm.eval()
    cfg = json.load(open(os.path.join(args.adapter, "adapter_config.json")))
    check(cfg.get("peft_type") == "LORA", "adapter_config.json peft_type %r" % cfg.get("peft_type"))
    # Every tensor of the file was taken into the model (PEFT warns of unexpected keys, so compare
    # the file's names with the model's LoRA parameters).
    names = set(load_file(os.path.join(args.adapter, "adapter_model.safetensors")))
    params = {k.replace(".default", "") for k, _ in pm.named_parameters() if "lora_" in k}
    check(names == params, "the adapter's tensors %s differ from PEFT's LoRA parameters %s" % (
        sorted(names ^ params)[:4], len(params)))
    ours = load_file(args.ours)
    ids = ours["ids"].tolist()
    with torch.no_grad():
        ref = pm(input_ids=torch.tensor([ids])).logits[0].float()
        base = fp.load_reference(args.base)(input_ids=torch.tensor([ids])).logits[0].float()
    moved = (ref - base).abs().max().item()
    check(moved > 10 * args.tol, "the adapter changes the logits by only %g: no training happened" % moved)
    for path in ("train", "serve"):
        diff = (ours[path] - ref).abs().max().item()
        print("lora_parity: %s on %s: PEFT's logits moved by up to %.3g from the base's; max |torchspeed %s (merged) - "
              "PEFT| = %.3g" % (args.adapter, args.base, moved, path, diff), flush=True)
        check(diff <= args.tol, "%s logits differ from PEFT's by %g > %g" % (path, diff, args.tol))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("root")
    s = sub.add_parser("serve")
    s.add_argument("base")
    s.add_argument("--cli", required=True)
    s.add_argument("--tol", type=float, default=1e-4)
    s.add_argument("--tp", type=int, default=1)
    r = sub.add_parser("refuse")
    r.add_argument("base")
    r.add_argument("--cli", required=True)
    p = sub.add_parser("peft")
    p.add_argument("base")
    p.add_argument("adapter")
    p.add_argument("ours")
    p.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    {"make": make, "serve": serve, "refuse": refuse, "peft": peft_logits}[args.cmd](args)
    finish("lora_parity " + args.cmd)


if __name__ == "__main__":
    main()
