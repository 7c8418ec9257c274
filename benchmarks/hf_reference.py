"""Hugging Face transformers' GPT2LMHeadModel as an independent implementation of torchspeed's GPT.

Used for (a) logits parity checks of the C++ model and (b) the speed baseline of the inference
server benchmark. Runs in scripts/bench-env's .venv-bench (torch, transformers, safetensors):

  .venv-bench/bin/python benchmarks/hf_reference.py selftest --model runs/demo-fp32/model
  .venv-bench/bin/python benchmarks/hf_reference.py logits --model DIR --tokens-file F --out O
  .venv-bench/bin/python benchmarks/hf_reference.py check --model DIR --expected E [--tol 1e-5]
  .venv-bench/bin/python benchmarks/hf_reference.py bench --model DIR --threads 2 --json OUT
  .venv-bench/bin/python benchmarks/hf_reference.py bench --gguf FILE --prompts P.json --json OUT
  .venv-bench/bin/python benchmarks/hf_reference.py make-random --out DIR --d-model 768 \
      --n-layer 12 --n-head 12 --seq-len 1024

A model folder holds config.json (torchspeed's training config; the GPT's shape is under "model":
vocab, seq_len, d_model, n_layer, n_head, dropout, tie_embeddings) and model.safetensors (fp32 or
bf16). The two models are the same function: pre-LayerNorm blocks (eps 1e-5)
    h = x + attn_proj(attn(ln1(x)));  out = h + mlp_proj(gelu(fc(ln2(h))))
with exact (erf) GELU, causal softmax attention scaled by 1/sqrt(head_dim), learned positions and
logits = ln_f(x) @ W_head^T, where W_head is embed.tok.weight when tie_embeddings is true. The
tokenizer is bytes: token id = byte value (vocab 256).

Tensor mapping (ours -> GPT2LMHeadModel). Our projections are torch.nn.Linear, weight [out, in];
GPT-2's are transformers' Conv1D, which computes x @ W + b with W stored [in, out], so every
projection weight is transposed (biases, LayerNorms and embeddings copy as they are):
    embed.tok.weight [V, d]                -> transformer.wte.weight [V, d]
    embed.pos.weight [T, d]                -> transformer.wpe.weight [T, d]
    block{i}.ln1.{weight,bias}             -> transformer.h.{i}.ln_1.{weight,bias}
    block{i}.qkv.weight [3d, d]            -> transformer.h.{i}.attn.c_attn.weight [d, 3d]   (.T)
    block{i}.qkv.bias [3d]                 -> transformer.h.{i}.attn.c_attn.bias
    block{i}.attn_proj.weight [d, d]       -> transformer.h.{i}.attn.c_proj.weight           (.T)
    block{i}.attn_proj.bias                -> transformer.h.{i}.attn.c_proj.bias
    block{i}.ln2.{weight,bias}             -> transformer.h.{i}.ln_2.{weight,bias}
    block{i}.fc.weight [4d, d]             -> transformer.h.{i}.mlp.c_fc.weight [d, 4d]      (.T)
    block{i}.fc.bias [4d]                  -> transformer.h.{i}.mlp.c_fc.bias
    block{i}.mlp_proj.weight [d, 4d]       -> transformer.h.{i}.mlp.c_proj.weight [4d, d]    (.T)
    block{i}.mlp_proj.bias                 -> transformer.h.{i}.mlp.c_proj.bias
    head.ln_f.{weight,bias}                -> transformer.ln_f.{weight,bias}
    head.weight [V, d] (untied only)       -> lm_head.weight [V, d] (nn.Linear; tied: = wte)
The qkv layouts already agree: our rows are q for all heads, then k, then v, head h at rows
h*hd..(h+1)*hd of each third; GPT-2 splits c_attn's output into thirds (q, k, v) and views each
third as [n_head, hd]. GPT2Config: activation_function="gelu" (erf; GPT-2's own "gelu_new" is the
tanh approximation), all dropouts 0, layer_norm_epsilon 1e-5, scale_attn_weights (1/sqrt(hd)), no
bos/eos token (GPT-2's 50256 is outside a byte vocabulary). Parity checks use the "eager"
attention (a plain matmul-softmax-matmul); the benchmark uses transformers' default, "sdpa".
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

FORTUNES_DIR = "/usr/share/games/fortunes"


# ---------------------------------------------------------------------------------------------
# Model folder <-> GPT2LMHeadModel


def read_shape(model_dir):
    """The GPT's shape from the folder's config.json ("model" section)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)["model"]
    shape = {
        "vocab": int(cfg.get("vocab", 256)),
        "seq_len": int(cfg["seq_len"]),
        "d_model": int(cfg["d_model"]),
        "n_layer": int(cfg["n_layer"]),
        "n_head": int(cfg["n_head"]),
        "tie_embeddings": bool(cfg.get("tie_embeddings", True)),
    }
    if shape["d_model"] % shape["n_head"]:
        raise ValueError(f"d_model {shape['d_model']} is not a multiple of n_head {shape['n_head']}")
    return shape


def read_tensors(model_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def tensor_map(shape):
    """HF parameter name -> (our tensor name, transpose?)."""
    m = {
        "transformer.wte.weight": ("embed.tok.weight", False),
        "transformer.wpe.weight": ("embed.pos.weight", False),
        "transformer.ln_f.weight": ("head.ln_f.weight", False),
        "transformer.ln_f.bias": ("head.ln_f.bias", False),
    }
    if not shape["tie_embeddings"]:
        m["lm_head.weight"] = ("head.weight", False)
    for i in range(shape["n_layer"]):
        hf, our = f"transformer.h.{i}.", f"block{i}."
        for hf_mod, our_mod, is_proj in (
            ("ln_1", "ln1", False),
            ("attn.c_attn", "qkv", True),
            ("attn.c_proj", "attn_proj", True),
            ("ln_2", "ln2", False),
            ("mlp.c_fc", "fc", True),
            ("mlp.c_proj", "mlp_proj", True),
        ):
            m[f"{hf}{hf_mod}.weight"] = (f"{our}{our_mod}.weight", is_proj)  # Conv1D: [in, out]
            m[f"{hf}{hf_mod}.bias"] = (f"{our}{our_mod}.bias", False)
    return m


def gpt2_config(shape, attn_implementation="eager"):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=shape["vocab"],
        n_positions=shape["seq_len"],
        n_embd=shape["d_model"],
        n_layer=shape["n_layer"],
        n_head=shape["n_head"],
        n_inner=4 * shape["d_model"],
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        tie_word_embeddings=shape["tie_embeddings"],
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        use_cache=True,
        attn_implementation=attn_implementation,
    )


def load_gpt2(model_dir, dtype=torch.float32, attn_implementation="eager"):
    """A GPT2LMHeadModel in eval mode holding the folder's weights (converted to dtype).

    Raises if a tensor of model.safetensors is left unused or has the wrong shape, or if a
    parameter of the HF model is not set from the file.
    """
    from transformers import GPT2LMHeadModel

    shape = read_shape(model_dir)
    tensors = read_tensors(model_dir)
    model = GPT2LMHeadModel(gpt2_config(shape, attn_implementation))
    mapping = tensor_map(shape)

    params = dict(model.named_parameters())  # tied lm_head.weight appears once, as wte
    if shape["tie_embeddings"] and model.lm_head.weight is not model.transformer.wte.weight:
        raise RuntimeError("tie_embeddings is set but lm_head.weight is not tied to transformer.wte.weight")
    unmapped = sorted(set(params) - set(mapping))
    if unmapped:
        raise RuntimeError(f"HF parameter {unmapped[0]} has no tensor in our format ({len(unmapped)} such)")

    used = {}
    with torch.no_grad():
        for hf_name, param in params.items():
            our_name, transpose = mapping[hf_name]
            if our_name not in tensors:
                raise KeyError(f"model.safetensors lacks {our_name} (for HF parameter {hf_name})")
            if our_name in used:
                raise RuntimeError(f"tensor {our_name} used twice ({used[our_name]} and {hf_name})")
            t = tensors[our_name]
            if transpose:
                t = t.t()
            if tuple(t.shape) != tuple(param.shape):
                raise ValueError(
                    f"{our_name}{' (transposed)' if transpose else ''} has shape {tuple(t.shape)}, "
                    f"HF parameter {hf_name} wants {tuple(param.shape)}"
                )
            param.copy_(t.to(param.dtype))
            used[our_name] = hf_name
    extra = sorted(set(tensors) - set(used))
    if extra:
        raise RuntimeError(f"tensor {extra[0]} of model.safetensors is not used ({len(extra)} such)")
    missing = sorted(set(mapping) - set(params))
    if missing:
        raise RuntimeError(f"expected HF parameter {missing[0]} does not exist in GPT2LMHeadModel")

    return model.to(dtype).eval()


# ---------------------------------------------------------------------------------------------
# An independent plain-torch implementation of the spec, for selftest


def reference_logits(tensors, shape, tokens, dtype=torch.float64):
    """Logits [t, vocab] of one sequence, straight from the spec with our tensor names."""
    w = {k: v.to(dtype) for k, v in tensors.items()}
    d, nh = shape["d_model"], shape["n_head"]
    hd, t = d // nh, len(tokens)
    ids = torch.tensor(tokens, dtype=torch.long)
    x = w["embed.tok.weight"][ids] + w["embed.pos.weight"][:t]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(shape["n_layer"]):
        p = lambda n: w[f"block{i}.{n}"]  # noqa: E731
        a = F.layer_norm(x, (d,), p("ln1.weight"), p("ln1.bias"), 1e-5)
        qkv = a @ p("qkv.weight").T + p("qkv.bias")
        q, k, v = (qkv[:, j * d:(j + 1) * d].reshape(t, nh, hd).transpose(0, 1) for j in range(3))
        s = (q @ k.transpose(1, 2)) / math.sqrt(hd)
        s = s.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (s @ v).transpose(0, 1).reshape(t, d)
        h = x + y @ p("attn_proj.weight").T + p("attn_proj.bias")
        u = F.layer_norm(h, (d,), p("ln2.weight"), p("ln2.bias"), 1e-5) @ p("fc.weight").T + p("fc.bias")
        u = 0.5 * u * (1.0 + torch.erf(u / math.sqrt(2.0)))  # exact GELU
        x = h + u @ p("mlp_proj.weight").T + p("mlp_proj.bias")
    x = F.layer_norm(x, (d,), w["head.ln_f.weight"], w["head.ln_f.bias"], 1e-5)
    head = w["embed.tok.weight"] if shape["tie_embeddings"] else w["head.weight"]
    return x @ head.T


# ---------------------------------------------------------------------------------------------
# Logits and checks


def hf_logits(model, sequences):
    """Full-sequence forward of each sequence (no cache): a list of [t, vocab] float tensors."""
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq], dtype=torch.long)
            out.append(model(input_ids=ids, use_cache=False).logits[0].float())
    return out


def check_tokens(sequences, shape):
    if not sequences or not all(isinstance(s, list) and s for s in sequences):
        raise ValueError('"tokens" must be a non-empty list of non-empty lists of token ids')
    for s in sequences:
        if len(s) > shape["seq_len"]:
            raise ValueError(f"a sequence of {len(s)} tokens is longer than seq_len {shape['seq_len']}")
        bad = [x for x in s if not 0 <= int(x) < shape["vocab"]]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary of {shape['vocab']}")


def cmd_logits(args):
    with open(args.tokens_file) as f:
        sequences = json.load(f)["tokens"]
    check_tokens(sequences, read_shape(args.model))
    model = load_gpt2(args.model, attn_implementation=args.attn)
    logits = hf_logits(model, sequences)
    with open(args.out, "w") as f:
        json.dump({"logits": [l.tolist() for l in logits]}, f)
    print(f"wrote logits of {len(sequences)} sequences to {args.out}")


def cmd_check(args):
    with open(args.expected) as f:
        expected = json.load(f)
    sequences = expected["tokens"]
    check_tokens(sequences, read_shape(args.model))
    if len(expected["logits"]) != len(sequences):
        raise ValueError(f'{len(sequences)} sequences of "tokens" but {len(expected["logits"])} of "logits"')
    model = load_gpt2(args.model, attn_implementation=args.attn)
    diff = 0.0
    for got, want in zip(hf_logits(model, sequences), expected["logits"]):
        want = torch.tensor(want, dtype=torch.float32)
        if want.shape != got.shape:
            raise ValueError(f"expected logits have shape {tuple(want.shape)}, HF gives {tuple(got.shape)}")
        diff = max(diff, (got - want).abs().max().item())
    print(f"max abs diff {diff:.3g}")
    if not diff <= args.tol:  # also fails on NaN
        print(f"hf logits differ: max abs diff {diff:.3g} > tol {args.tol:g}")
        return 1
    print("hf logits match")
    return 0


def cmd_selftest(args):
    shape = read_shape(args.model)
    tensors = read_tensors(args.model)
    gen = torch.Generator().manual_seed(0)
    lengths = [shape["seq_len"], max(1, shape["seq_len"] // 3), 1]
    sequences = [torch.randint(0, shape["vocab"], (n,), generator=gen).tolist() for n in lengths]
    ref64 = [reference_logits(tensors, shape, s, torch.float64) for s in sequences]
    ref32 = [reference_logits(tensors, shape, s, torch.float32) for s in sequences]
    scale = max(r.abs().max().item() for r in ref64)
    ok = True
    for dtype, ref, tol in ((torch.float64, ref64, 1e-9), (torch.float32, ref32, args.tol)):
        for attn in ("eager", "sdpa"):
            model = load_gpt2(args.model, dtype=dtype, attn_implementation=attn)
            with torch.no_grad():
                got = [model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in sequences]
            diff = max((g.double() - r.double()).abs().max().item() for g, r in zip(got, ref))
            name = str(dtype).replace("torch.", "")
            print(f"{name:8} {attn:5}  HF vs plain-torch reference: max abs diff {diff:.3g} (tol {tol:g})")
            ok &= diff <= tol
    print(f"(sequence lengths {lengths}, max |logit| {scale:.3g})")
    print("selftest passed" if ok else "selftest FAILED")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# Random model in our format


def cmd_make_random(args):
    from safetensors.torch import save_file

    d, v, t, nl = args.d_model, args.vocab, args.seq_len, args.n_layer
    if d % args.n_head:
        raise ValueError(f"d-model {d} is not a multiple of n-head {args.n_head}")
    gen = torch.Generator().manual_seed(args.seed)
    normal = lambda *s: torch.empty(*s).normal_(0.0, 0.02, generator=gen)  # noqa: E731
    tensors = {"embed.tok.weight": normal(v, d), "embed.pos.weight": normal(t, d)}
    for i in range(nl):
        b = f"block{i}."
        for name, out_f, in_f in (("qkv", 3 * d, d), ("attn_proj", d, d),
                                  ("fc", 4 * d, d), ("mlp_proj", d, 4 * d)):
            tensors[b + name + ".weight"] = normal(out_f, in_f)
            tensors[b + name + ".bias"] = torch.zeros(out_f)
        for ln in ("ln1", "ln2"):
            tensors[b + ln + ".weight"] = torch.ones(d)
            tensors[b + ln + ".bias"] = torch.zeros(d)
    tensors["head.ln_f.weight"], tensors["head.ln_f.bias"] = torch.ones(d), torch.zeros(d)
    if args.untied:
        tensors["head.weight"] = normal(v, d)
    os.makedirs(args.out, exist_ok=True)
    save_file({k: x.contiguous() for k, x in tensors.items()}, os.path.join(args.out, "model.safetensors"))
    config = {"model": {"vocab": v, "seq_len": t, "d_model": d, "n_layer": nl, "n_head": args.n_head,
                        "dropout": 0.0, "tie_embeddings": not args.untied}}
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    n = sum(x.numel() for x in tensors.values())
    print(f"wrote a random GPT (d {d}, {nl} layers, {args.n_head} heads, seq_len {t}, vocab {v}, "
          f"{n / 1e6:.1f}M parameters) to {args.out}")


# ---------------------------------------------------------------------------------------------
# Generation benchmark


def fortunes_corpus():
    """The bytes of the fortune files (text files; .dat indexes and .u8 links skipped)."""
    data = bytearray()
    for name in sorted(os.listdir(FORTUNES_DIR)):
        path = os.path.join(FORTUNES_DIR, name)
        if name.endswith(".dat") or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data += f.read()
    if not data:
        raise RuntimeError(f"no fortune files under {FORTUNES_DIR} (Debian package fortunes)")
    return bytes(data)


def prompts(corpus, n, length, vocab):
    """n prompts of length byte tokens, taken at evenly spaced offsets of the corpus."""
    if len(corpus) < n * length:
        raise RuntimeError(f"the corpus has {len(corpus)} bytes, fewer than {n} prompts of {length}")
    stride = len(corpus) // n
    rows = [list(corpus[i * stride:i * stride + length]) for i in range(n)]
    return torch.tensor(rows, dtype=torch.long) % vocab


def timed(fn, reps):
    """Median wall seconds of reps calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cmd_bench(args):
    torch.set_num_threads(args.threads)
    if bool(args.gguf) == bool(args.model):
        raise ValueError("bench: give --model or --gguf (with --prompts)")
    if args.gguf:
        return bench_gguf(args)
    shape = read_shape(args.model)
    prompt_len, new_tokens = args.prompt_len, args.new_tokens
    if prompt_len < 1 or new_tokens < 2:
        raise ValueError("--prompt-len must be >= 1 and --new-tokens >= 2")
    if prompt_len >= shape["seq_len"]:
        raise ValueError(f"--prompt-len {prompt_len} leaves no room within seq_len {shape['seq_len']}")
    if prompt_len + new_tokens > shape["seq_len"]:
        clipped = shape["seq_len"] - prompt_len
        print(f"note: prompt-len {prompt_len} + new-tokens {new_tokens} exceeds seq_len {shape['seq_len']}; "
              f"generating {clipped} new tokens")
        new_tokens = clipped

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = load_gpt2(args.model, dtype=dtype, attn_implementation=args.attn)
    corpus = fortunes_corpus()
    one = prompts(corpus, 1, prompt_len, shape["vocab"])
    many = prompts(corpus, args.batch, prompt_len, shape["vocab"])
    return bench_generate(args, model, one, many, new_tokens, "GPT2LMHeadModel")


def bench_gguf(args):
    """The speed of transformers' LlamaForCausalLM on a GGUF file (dequantized as transformers
    loads it), with the token-id prompts of --prompts (the ones the server gets)."""
    from transformers import AutoModelForCausalLM

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(args.gguf)),
                                                 gguf_file=os.path.basename(args.gguf), dtype=dtype,
                                                 attn_implementation=args.attn)
    model.eval()
    with open(args.prompts) as f:
        rows = json.load(f)["prompts"]
    if len(rows) < args.batch or len({len(r) for r in rows}) != 1:
        raise ValueError(f"--prompts needs at least {args.batch} prompts of one length")
    ids = torch.tensor(rows[:args.batch], dtype=torch.long)
    return bench_generate(args, model, ids[:1], ids, args.new_tokens, type(model).__name__)


def bench_generate(args, model, one, many, new_tokens, arch):
    """batch-1 prefill and decode rates and the batched rate of model.generate (greedy, the KV
    cache on, exactly new_tokens per prompt)."""
    import transformers

    prompt_len = one.shape[1]
    params = sum(p.numel() for p in model.parameters())  # tied head counted once

    def generate(ids, n):
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),  # equal-length prompts: no padding
            do_sample=False,
            num_beams=1,
            max_new_tokens=n,
            min_new_tokens=n,
            use_cache=True,
        )
        assert out.shape == (ids.shape[0], ids.shape[1] + n), out.shape

    def prefill():
        model(input_ids=one, attention_mask=torch.ones_like(one), use_cache=True)

    reps = args.reps
    with torch.inference_mode():
        prefill_s = timed(prefill, reps)
        gen1_s = timed(lambda: generate(one, 1), reps)  # prefill + first token
        genn_s = timed(lambda: generate(one, new_tokens), reps)
        batched_s = timed(lambda: generate(many, new_tokens), reps)
    decode_tok_s = (new_tokens - 1) / (genn_s - gen1_s)
    batched_tok_s = args.batch * new_tokens / batched_s

    result = {
        "impl": "transformers",
        "model_class": arch,
        "version": transformers.__version__,
        "torch": torch.__version__,
        "threads": args.threads,
        "dtype": args.dtype,
        "attn_implementation": args.attn,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "reps": reps,
        "batch1_decode_tok_s": round(decode_tok_s, 2),
        "batch1_prefill_ms": round(prefill_s * 1e3, 2),
        "batch1_generate_s": round(genn_s, 4),
        "batched_tok_s": round(batched_tok_s, 2),
        "batched_generate_s": round(batched_s, 4),
        "batch": args.batch,
        "params": params,
        "loadavg_after": round(os.getloadavg()[0], 2),
    }
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {args.threads} threads, "
          f"{args.dtype}, attn {args.attn}, {params / 1e6:.1f}M parameters, "
          f"prompt {prompt_len} + {new_tokens} new tokens, median of {reps}")
    print(f"  {'batch 1 prefill':28} {prefill_s * 1e3:10.1f} ms")
    print(f"  {'batch 1 decode':28} {decode_tok_s:10.1f} tok/s   (generate {genn_s:.2f} s)")
    print(f"  {f'batch {args.batch} generate (output)':28} {batched_tok_s:10.1f} tok/s   "
          f"(generate {batched_s:.2f} s incl. prefill)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


# ---------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def model_arg(p):
        p.add_argument("--model", required=True, help="model folder (config.json, model.safetensors)")

    def attn_arg(p, default):
        p.add_argument("--attn", default=default, choices=["eager", "sdpa"],
                       help=f"transformers attention implementation (default {default})")

    p = sub.add_parser("logits", help="full-sequence logits of token sequences as JSON")
    model_arg(p)
    p.add_argument("--tokens-file", required=True, help='JSON {"tokens": [[ids...], ...]}')
    p.add_argument("--out", required=True, help='output JSON {"logits": [[[...]]]}')
    attn_arg(p, "eager")

    p = sub.add_parser("check", help="compare HF logits with expected ones (exit 1 beyond --tol)")
    model_arg(p)
    p.add_argument("--expected", required=True, help='JSON {"tokens": [[...]], "logits": [[[...]]]}')
    p.add_argument("--tol", type=float, default=1e-5)
    attn_arg(p, "eager")

    p = sub.add_parser("selftest", help="HF model vs a plain-torch reference of the spec")
    model_arg(p)
    p.add_argument("--tol", type=float, default=1e-4, help="fp32 tolerance (fp64: 1e-9)")

    p = sub.add_parser("bench", help="transformers generation speed")
    p.add_argument("--model", help="model folder (config.json, model.safetensors)")
    p.add_argument("--gguf", help="a GGUF file instead of --model (transformers dequantizes it)")
    p.add_argument("--prompts", help='with --gguf: JSON {"prompts": [[ids...], ...]}, equal lengths')
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (median), after one warm-up")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    attn_arg(p, "sdpa")
    p.add_argument("--json", help="write the results as JSON here")

    p = sub.add_parser("make-random", help="write a GPT-2-style randomly initialised model folder")
    p.add_argument("--out", required=True)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--untied", action="store_true", help="separate head.weight (tie_embeddings false)")
    p.add_argument("--seed", type=int, default=1234)

    args = ap.parse_args(argv)
    fn = {"logits": cmd_logits, "check": cmd_check, "selftest": cmd_selftest, "bench": cmd_bench,
          "make-random": cmd_make_random}[args.cmd]
    return fn(args) or 0


if __name__ == "__main__":
    sys.exit(main())
