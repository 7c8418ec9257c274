#!/usr/bin/env python3
"""The model families against Hugging Face transformers: each family's own config class makes a
random-initialised model, and torchspeed must compute what transformers computes.

  families_parity.py make ROOT
      ROOT/tokenizer: a byte-level BPE tokenizer trained by `tokenizers` on the fortunes corpus.
      ROOT/<family> for each of FAMILIES: a model made by transformers with its own config class
      (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config; small widths, random weights from a
      fixed seed, spread wider than the default initialisation), saved with save_pretrained, the
      tokenizer beside it. ROOT/text.txt: a passage of the corpus.
  families_parity.py logits DIR OURS --text TEXT [--tol T]
      transformers' logits for OURS "ids" equal OURS "train" and "serve" (torchspeed's training
      stack and serving model, tests/hf/gpt2_logits.cpp) within T (1e-4).
  families_parity.py serve DIR --cli TORCHSPEED [--weights fp32|bf16] [--tol T]
      `torchspeed serve` on DIR: /v1/completions with the prompt as token ids, echo and logprobs,
      64 greedy tokens: the prompt's and the generated tokens' log-probabilities within T of
      transformers' (fp32: 1e-4), and the 64 tokens' text equal to transformers' greedy
      generate (fp32; bf16 weights: the first 8 tokens).
  families_parity.py tokens MODEL IDS.json
      torchspeed's ids of each file in IDS.json (tests/tokenizer/encode_files.cpp) equal the
      Hugging Face tokenizer's of MODEL (a folder, or a GGUF file as transformers reads it).
  families_parity.py changed DIR DIR0
      DIR (e.g. `torchspeed convert --format hf` of a fine-tuned model) loads in transformers as
      the same class with no missing or unexpected tensor, and its weights differ from DIR0's.
Each check prints a line; failures print "FAIL ..." and exit 1.
"""
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import FORTUNES, check, corpus_files, finish  # noqa: E402

VOCAB = 1024  # the tokenizer's size; each model's vocabulary is a little larger (unused rows)


def family_configs():
    """One small model per family, each exercising what sets it apart."""
    from transformers import (LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                              Qwen3MoeConfig)

    common = dict(vocab_size=VOCAB + 8, max_position_embeddings=128, num_hidden_layers=2, rms_norm_eps=1e-5)
    return {
        # Llama 2: multi-head attention, untied head; both bias options on (attention_bias, mlp_bias).
        "llama2": LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=4,
                              tie_word_embeddings=False, attention_bias=True, mlp_bias=True, rope_theta=10000.0,
                              **common),
        # Llama 3.2: grouped-query attention, tied head, llama3 rope scaling (original context 32).
        "llama3": LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                              tie_word_embeddings=True, rope_theta=500000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                              **common),
        # SmolLM2's shape in small: 3 query heads, 1 KV head (multi-query), tied, theta 100000.
        "smollm2": LlamaConfig(hidden_size=96, intermediate_size=256, num_attention_heads=3, num_key_value_heads=1,
                               tie_word_embeddings=True, rope_theta=100000.0, **common),
        # Mistral without a sliding window; head_dim set apart from hidden / heads; linear scaling.
        "mistral": MistralConfig(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=32, sliding_window=None, tie_word_embeddings=False,
                                 rope_scaling={"rope_type": "linear", "factor": 2.0}, **common),
        # Qwen2: q/k/v biases, yarn rope scaling.
        "qwen2": Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=False, use_sliding_window=False, rope_theta=1000000.0,
                             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                             **common),
        # Qwen3: per-head q/k RMSNorm, head_dim 32 with hidden 64 and 4 heads, tied.
        "qwen3": Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, tie_word_embeddings=True, use_sliding_window=False, **common),
        # Mixture of experts (issue 39): Mixtral, 4 experts, 2 per token, renormalised; the
        # load-balancing loss on (output_router_logits), so fine-tuning trains with it.
        "mixtral": MixtralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                 num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                                 tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.02,
                                 **common),
        # Qwen2-MoE: q/k/v biases, a gated shared expert, weights not renormalised.
        "qwen2_moe": Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                                    shared_expert_intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                                    norm_topk_prob=False, num_attention_heads=4, num_key_value_heads=2,
                                    tie_word_embeddings=False, use_sliding_window=False, **common),
        # Qwen3-MoE: q/k norms, 3 of 6 experts per token, renormalised.
        "qwen3_moe": Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_experts=6,
                                    num_experts_per_tok=3, norm_topk_prob=True, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                                    use_sliding_window=False, **common),
    }


def make(args):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoModelForCausalLM

    os.makedirs(args.root, exist_ok=True)
    tdir = os.path.join(args.root, "tokenizer")
    os.makedirs(tdir, exist_ok=True)
    tok = ByteLevelBPETokenizer()
    tok.train(corpus_files(), vocab_size=VOCAB, min_frequency=2, show_progress=False)
    tok.save(os.path.join(tdir, "tokenizer.json"))
    with open(os.path.join(FORTUNES, "fortunes"), encoding="utf-8", errors="replace") as f:
        text = f.read()[:400]
    with open(os.path.join(args.root, "text.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(text)
    for i, (name, cfg) in enumerate(family_configs().items()):
        torch.manual_seed(100 + i)
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
        # Wider than the initialisation (std 0.02; norms at 1), so that logits differ between
        # tokens and positions by more than the tolerance and every weight matters.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        d = os.path.join(args.root, name)
        model.save_pretrained(d)
        shutil.copy(os.path.join(tdir, "tokenizer.json"), os.path.join(d, "tokenizer.json"))
        print("families_parity make: %s: %s, %d layers, d %d, heads %d/%d, %.2fM parameters" % (
            d, cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, sum(p.numel() for p in model.parameters()) / 1e6), flush=True)


class HFTokenizer:
    """tokenizer.json through `tokenizers`, or a GGUF file's tokenizer through transformers."""

    def __init__(self, model):
        if model.endswith(".gguf"):
            from transformers import AutoTokenizer
            self.t = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(model)),
                                                   gguf_file=os.path.basename(model))
            self.fast = False
            # transformers' GGUF converter keeps GPT-2's ByteLevel pre-tokenizer for every
            # tokenizer.ggml.pre; "smollm" also splits digits one by one (SmolLM2's own
            # tokenizer.json: Sequence [Digits(individual_digits), ByteLevel], and llama.cpp's
            # LLAMA_VOCAB_PRE_TYPE_SMOLLM). Restore it, so the reference is SmolLM2's tokenizer.
            from gguf import GGUFReader
            from tokenizers import pre_tokenizers
            field = GGUFReader(model).fields.get("tokenizer.ggml.pre")
            if field is not None and field.contents() == "smollm":
                self.t.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        else:
            from tokenizers import Tokenizer
            self.t = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
            self.fast = True

    def encode(self, text):
        return self.t.encode(text).ids if self.fast else self.t(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids):
        return self.t.decode(ids) if self.fast else self.t.decode(ids, skip_special_tokens=False)


def load_reference(d):
    from transformers import AutoModelForCausalLM

    kw = {}
    if d.endswith(".gguf"):  # transformers dequantizes the file's tensors to fp32
        kw["gguf_file"] = os.path.basename(d)
        d = os.path.dirname(os.path.abspath(d))
    model, info = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", output_loading_info=True,
                                                       dtype=torch.float32, **kw)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        check(not info.get(k), "%s: transformers reports %s: %s" % (d, k, info.get(k)))
    model.eval()
    return model


def logits(args):
    from safetensors.torch import load_file

    model = load_reference(args.dir)
    ours = load_file(args.ours)
    ids = ours["ids"].tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    spread = (ref.max() - ref.min()).item()
    check(spread > 1e-1, "the reference logits are nearly constant (spread %g): the check would be weak" % spread)
    for path in ("train", "serve"):
        diff = (ours[path] - ref).abs().max().item()
        print("families_parity: %s: %d tokens x %d logits, max |torchspeed %s - transformers| = %.3g (span %.3g)" % (
            args.dir, len(ids), ref.shape[1], path, diff, spread), flush=True)
        check(diff <= args.tol, "%s: %s logits differ from transformers' by %g > %g" % (args.dir, path, diff, args.tol))


def free_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
    finally:
        s.close()


def post(port, path, body, timeout=120):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def serve(args):
    model = load_reference(args.dir)
    tok = HFTokenizer(args.dir)
    text_path = args.text or os.path.join(os.path.dirname(os.path.abspath(args.dir)), "text.txt")
    with open(text_path, encoding="utf-8") as f:
        prompt_ids = tok.encode(f.read())[:40]
    new = 64
    with torch.no_grad():
        model.generation_config.eos_token_id = None
        # An explicit all-ones attention mask: with a pad token id that the prompt holds,
        # generate would mask those prompt tokens out.
        x = torch.tensor([prompt_ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                             pad_token_id=model.config.vocab_size - 1, eos_token_id=None)[0].tolist()
        logp = torch.log_softmax(model(torch.tensor([out])).logits[0].double(), -1)
    ref_lp = [logp[i - 1, out[i]].item() for i in range(1, len(out))]
    port = free_port()
    log = open(os.path.basename(args.dir) + ".serve-%s-tp%d.log" % (args.weights, args.tp), "w")
    cmd = [args.cli, "serve", "--checkpoint", args.dir, "--host", "127.0.0.1", "--port", str(port), "--weights",
           args.weights, "--served-model-name", "m", "--tp", str(args.tp)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                log.close()
                check(False, "%s: the server exited with %s while starting: %s" % (
                    args.dir, proc.returncode, open(log.name).read()[-2000:]))
                return
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                check(False, "%s: the server did not turn healthy in 120 s" % args.dir)
                return
            time.sleep(0.25)
        r = post(port, "/v1/completions", {"model": "m", "prompt": prompt_ids, "max_tokens": new, "temperature": 0,
                                           "echo": True, "logprobs": 0})
        choice = r["choices"][0]
        lps = choice["logprobs"]["token_logprobs"]
        check(len(lps) == len(prompt_ids) + new and lps[0] is None,
              "%s: %d token_logprobs (first %r), want %d with the first null" % (
                  args.dir, len(lps), lps[0] if lps else None, len(prompt_ids) + new))
        got_text = choice["text"]
        ref_text = tok.decode(out)
        n = len(prompt_ids)
        if args.weights == "fp32":
            ok_tokens = got_text == ref_text
            check(ok_tokens, "%s: the %d greedy tokens differ from transformers': %r vs %r" % (
                args.dir, new, got_text[-200:], ref_text[-200:]))
            diff = max(abs(a - b) for a, b in zip(lps[1:], ref_lp))
            print("families_parity: %s serve fp32: %d prompt + %d greedy tokens equal to transformers': %s; "
                  "max |logprob difference| %.3g" % (args.dir, n, new, ok_tokens, diff), flush=True)
            check(diff <= args.tol, "%s: log-probabilities differ from transformers' by %g > %g" % (args.dir, diff, args.tol))
        else:
            # Rounded weights: the prompt's log-probabilities within the tolerance, and the start of
            # the greedy continuation (a near tie may flip a later token).
            diff = max(abs(a - b) for a, b in zip(lps[1:n], ref_lp[:n - 1]))
            prefix = tok.decode(out[:n + 8])
            print("families_parity: %s serve %s: prompt max |logprob difference| %.3g; first 8 greedy tokens equal: %s" % (
                args.dir, args.weights, diff, got_text.startswith(prefix)), flush=True)
            check(diff <= args.tol, "%s: %s prompt log-probabilities differ by %g > %g" % (args.dir, args.weights, diff, args.tol))
            check(got_text.startswith(prefix), "%s: %s greedy start %r, transformers' %r" % (
                args.dir, args.weights, got_text[:len(prefix)], prefix))
        if args.chat:
            # The model's own chat template through /v1/chat/completions: the answer equals
            # transformers' greedy answer to apply_chat_template's prompt.
            msgs = [{"role": "user", "content": args.chat}]
            with torch.no_grad():
                ids = tok.t.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                     do_sample=False)[0, ids.shape[1]:].tolist()
            eos = set()
            for e in (model.generation_config.eos_token_id, model.config.eos_token_id, tok.t.eos_token_id):
                eos |= set(e if isinstance(e, list) else [e])
            eos.discard(None)
            cut = next((i for i, t in enumerate(gen) if t in eos), len(gen))
            ref_answer = tok.t.decode(gen[:cut])
            r = post(port, "/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 24, "temperature": 0})
            answer = r["choices"][0]["message"]["content"]
            print("families_parity: %s chat %r -> %r (transformers: %r, finish %s)" % (
                args.dir, args.chat, answer, ref_answer, r["choices"][0]["finish_reason"]), flush=True)
            check(answer == ref_answer, "%s: chat answer %r, transformers' %r" % (args.dir, answer, ref_answer))
            if args.expect:
                check(args.expect in answer, "%s: the chat answer %r does not contain %r" % (args.dir, answer, args.expect))
            if r["choices"][0]["finish_reason"] == "stop":
                # vLLM's ignore_eos: the same answer, then on past the end of turn to max_tokens.
                r2 = post(port, "/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 24, "temperature": 0,
                                                         "ignore_eos": True})
                c2 = r2["choices"][0]
                print("families_parity: %s chat with ignore_eos: finish %s, %d tokens" % (
                    args.dir, c2["finish_reason"], r2["usage"]["completion_tokens"]), flush=True)
                check(c2["finish_reason"] == "length" and r2["usage"]["completion_tokens"] == 24 and
                      c2["message"]["content"].startswith(answer),
                      "%s: ignore_eos gave %r (finish %s, %d tokens)" % (args.dir, c2["message"]["content"],
                                                                          c2["finish_reason"], r2["usage"]["completion_tokens"]))
        # /v1/embeddings (vLLM's pooling, last token, L2-normalized): transformers' last hidden
        # state (after the final norm) at each input's last token.
        inputs = [prompt_ids, prompt_ids[:7]]
        r = post(port, "/v1/embeddings", {"model": "m", "input": inputs})
        for k, ids in enumerate(inputs):
            with torch.no_grad():
                h = model.base_model(torch.tensor([ids])).last_hidden_state[0, -1].double()
            ref = h / h.norm()
            got = torch.tensor(r["data"][k]["embedding"], dtype=torch.float64)
            diff = (got - ref).abs().max().item()
            print("families_parity: %s embeddings %s of %d tokens: %d values, max |difference| %.3g" % (
                args.dir, args.weights, len(ids), got.numel(), diff), flush=True)
            check(got.numel() == ref.numel() and diff <= args.tol,
                  "%s: the embedding of %d tokens differs from transformers' by %g > %g" % (args.dir, len(ids), diff, args.tol))
        check(r["usage"]["prompt_tokens"] == sum(len(i) for i in inputs), "embeddings usage %r" % r["usage"])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            check(False, "%s: the server did not stop within 30 s of SIGTERM" % args.dir)
        log.close()


def tokens(args):
    tok = HFTokenizer(args.model)
    ours = json.load(open(args.ids))
    total = 0
    for path, ids in sorted(ours.items()):
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
        ref = tok.encode(text)
        total += len(ref)
        same = ids == ref
        if not same:
            k = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
            check(False, "%s: token %d differs: ours %s, Hugging Face's %s (%r)" % (
                path, k, ids[k:k + 5], ref[k:k + 5], tok.decode(ref[max(0, k - 3):k + 3])))
        else:
            check(True, "")
    print("families_parity tokens: %s: %d files, %d tokens compared with Hugging Face's tokenizer" % (
        args.model, len(ours), total), flush=True)


def changed(args):
    from safetensors.torch import load_file

    load_reference(args.dir)
    a = load_file(os.path.join(args.dir, "model.safetensors"))
    b = load_file(os.path.join(args.base, "model.safetensors"))
    check(set(a) == set(b), "tensor names differ from %s: %s" % (args.base, sorted(set(a) ^ set(b))))
    delta = max((a[k].float() - b[k].float()).abs().max().item() for k in a if k in b)
    print("families_parity: largest weight change of %s from %s: %.3g" % (args.dir, args.base, delta), flush=True)
    check(delta > 1e-4, "the weights of %s equal those of %s: no training happened" % (args.dir, args.base))
    ca = json.load(open(os.path.join(args.dir, "config.json")))
    cb = json.load(open(os.path.join(args.base, "config.json")))
    check(ca["model_type"] == cb["model_type"], "model_type %s, was %s" % (ca["model_type"], cb["model_type"]))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("root")
    lg = sub.add_parser("logits")
    lg.add_argument("dir")
    lg.add_argument("ours")
    lg.add_argument("--tol", type=float, default=1e-4)
    s = sub.add_parser("serve")
    s.add_argument("dir")
    s.add_argument("--cli", required=True)
    s.add_argument("--weights", default="fp32")
    s.add_argument("--tp", type=int, default=1, help="serve --tp (a MoE model: its experts spread over the ranks)")
    s.add_argument("--tol", type=float, default=1e-4)
    s.add_argument("--text")
    s.add_argument("--chat", help="also ask this through /v1/chat/completions (the model's chat template)")
    s.add_argument("--expect", help="a word the chat answer must contain")
    t = sub.add_parser("tokens")
    t.add_argument("model")
    t.add_argument("ids")
    c = sub.add_parser("changed")
    c.add_argument("dir")
    c.add_argument("base")
    args = ap.parse_args()
    torch.set_num_threads(1)
    {"make": make, "logits": logits, "serve": serve, "tokens": tokens, "changed": changed}[args.cmd](args)
    finish("families_parity %s" % args.cmd)


if __name__ == "__main__":
    main()
