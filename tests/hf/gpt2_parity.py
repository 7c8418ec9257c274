#!/usr/bin/env python3
"""GPT-2 in and out against Hugging Face: transformers' GPT2LMHeadModel and the `tokenizers`
package are the references (scripts/bench-env's .venv-bench holds them).

  gpt2_parity.py make DIR --text TEXT_OUT
      A GPT-2-shaped model created by transformers (GPT-2's vocabulary of 50257, tanh GELU
      "gelu_new", tied head; small width and depth, random weights from a fixed seed), saved with
      save_pretrained(DIR), and beside it a byte-level BPE tokenizer trained by `tokenizers` on
      the fortunes corpus (tokenizer.json, vocab.json, merges.txt). TEXT_OUT: a passage of the
      corpus for the logits check.
  gpt2_parity.py check DIR OURS --text TEXT [--changed-from DIR0] [--generated FILE --prompt P]
      DIR loads in transformers with no missing or unexpected tensor; the ids torchspeed encoded
      (OURS "ids") equal `tokenizers`' ids of TEXT; transformers' logits for them equal OURS
      "train" and "serve" to 1e-5. --changed-from: DIR's weights differ from DIR0's (training
      happened). --generated: FILE (`torchspeed generate --temperature 0` output) equals
      transformers' greedy continuation of P.
Prints "gpt2_parity: all N checks passed", or "FAIL ..." lines and exits 1.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import FORTUNES, check, corpus_files, finish  # noqa: E402


def make(args):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    os.makedirs(args.dir, exist_ok=True)
    tok = ByteLevelBPETokenizer()
    tok.train(corpus_files(), vocab_size=50257, min_frequency=2, show_progress=False)
    tok.save(os.path.join(args.dir, "tokenizer.json"))
    tok.save_model(args.dir)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50257, n_positions=64, n_embd=64, n_layer=2, n_head=4)  # GPT-2's defaults otherwise
    model = GPT2LMHeadModel(cfg)
    # Larger than GPT-2's initialisation (std 0.02), so that the logits differ between tokens
    # and positions by more than the tolerance.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(args.dir)
    with open(os.path.join(FORTUNES, "fortunes"), encoding="utf-8", errors="replace") as f:
        text = f.read()[:600]
    with open(args.text, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    print("gpt2_parity make: %s: vocab %d (tokenizer %d), %d layers, d %d, activation %s, %.2fM parameters" % (
        args.dir, cfg.vocab_size, tok.get_vocab_size(), cfg.n_layer, cfg.n_embd, cfg.activation_function,
        sum(p.numel() for p in model.parameters()) / 1e6))


def run_check(args):
    from tokenizers import Tokenizer
    from transformers import GPT2LMHeadModel

    model, info = GPT2LMHeadModel.from_pretrained(args.dir, attn_implementation="eager", output_loading_info=True)
    model.eval()
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        check(not info.get(k), "%s: transformers reports %s: %s" % (args.dir, k, info.get(k)))
    ours = load_file(args.ours)
    ids = ours["ids"].tolist()
    tok = Tokenizer.from_file(os.path.join(args.dir, "tokenizer.json"))
    with open(args.text, encoding="utf-8", newline="") as f:
        ref_ids = tok.encode(f.read()).ids[: len(ids)]
    check(ids == ref_ids, "token ids differ from tokenizers': first difference at %s" % next(
        (i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), len(ids)))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    spread = (ref.max() - ref.min()).item()
    check(spread > 1e-2, "the reference logits are nearly constant (spread %g): the check would be weak" % spread)
    for path in ("train", "serve"):
        diff = (ours[path] - ref).abs().max().item()
        print("gpt2_parity: %s: %d tokens x %d logits, max |torchspeed %s - transformers| = %.3g (logits span %.3g)" % (
            args.dir, len(ids), ref.shape[1], path, diff, spread), flush=True)
        check(diff <= args.tol, "%s logits differ from transformers' by %g > %g" % (path, diff, args.tol))
    if args.changed_from:
        a, b = load_file(os.path.join(args.dir, "model.safetensors")), load_file(
            os.path.join(args.changed_from, "model.safetensors"))
        check(set(a) == set(b), "tensor names differ from %s: %s" % (args.changed_from, sorted(set(a) ^ set(b))))
        delta = max((a[k].float() - b[k].float()).abs().max().item() for k in a if k in b)
        print("gpt2_parity: largest weight change from %s: %.3g" % (args.changed_from, delta))
        check(delta > 1e-4, "the weights equal those of %s: no training happened" % args.changed_from)
        cfg = json.load(open(os.path.join(args.dir, "config.json")))
        check(cfg.get("activation_function") == "gelu_new", "config.json activation_function is %s" % cfg.get("activation_function"))
    if args.generated:
        prompt_ids = tok.encode(args.prompt).ids
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                                 pad_token_id=0)
        ref_text = args.prompt + tok.decode(out[0, len(prompt_ids):].tolist())
        with open(args.generated, encoding="utf-8", newline="") as f:
            got = f.read()
        got = got[:-1] if got.endswith("\n") else got
        print("gpt2_parity: greedy continuation: %r" % got)
        check(got == ref_text, "torchspeed generate gave %r, transformers' greedy generate %r" % (got, ref_text))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    m.add_argument("--text", required=True)
    c = sub.add_parser("check")
    c.add_argument("dir")
    c.add_argument("ours")
    c.add_argument("--text", required=True)
    c.add_argument("--tol", type=float, default=1e-5)
    c.add_argument("--changed-from")
    c.add_argument("--generated")
    c.add_argument("--prompt", default="The")
    c.add_argument("--max-new-tokens", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cmd == "make":
        make(args)
        return
    run_check(args)
    finish("gpt2_parity")


if __name__ == "__main__":
    main()
