"""The peers of `torchspeed bench train`: what a user would run instead of torchspeed.

Trains the same model as torchspeed on random tokens with AdamW, 2 processes on one machine, and
prints one JSON line with the tokens per second of the timed steps. The model:

  --arch gpt        torchspeed's GPT-2 shape (pre-LN blocks, exact GELU, learned positions, tied
                    LM head, byte vocabulary), written out here
  --arch llama      transformers' LlamaForCausalLM (SDPA attention) loaded with from_pretrained
                    from --init, a folder --save-init wrote once (torchspeed loads the same
                    folder, so both train the same weights)
  --arch moe        the GPT shape with each MLP a Mixture of Experts: DeepSpeed-MoE's layer
                    (deepspeed.moe.layer.MoE, its top-k gate with capacity factor 1, tokens
                    dropped in position order: use_rts off, as torchspeed drops them) over
                    --experts SwiGLU experts of width --d_ff, --k per token, spread over --ep
                    ranks (all-to-all); its load-balancing loss x 0.01 added to the loss, as
                    torchspeed's model.moe.aux_loss_coef. --impl deepspeed only

  --bf16            bf16 compute: DDP under torch.autocast (fp32 weights, bf16 matrix products),
                    DeepSpeed with its "bf16" section (bf16 weights, fp32 master copies)

The implementations:

  --impl ddp        torch.nn.parallel.DistributedDataParallel over gloo
  --impl deepspeed  deepspeed.initialize with ZeRO --stage 2 or 3 (DeepSpeed's CPU accelerator;
                    gloo, since oneCCL is not on PyPI for this torch), DeepSpeed's own Adam

Each process gets its best thread setup for 2 processes on 2 cores: one intra-op thread, one
BLAS thread, passive OpenMP waiting (set in the environment before torch loads) and its own core.
Runs under torch 2.x (scripts/bench-env's .venv-bench) or Debian's torch 1.13 (DDP only; attention
spelled out where F.scaled_dot_product_attention does not exist). Started by bench train with
--nproc 2: the script starts its own processes with torchrun's environment variables (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); Debian's torch 1.13 torchrun fails under
Python 3.11. Alone:
  .venv-bench/bin/python benchmarks/peers_gpt.py --nproc 2 --impl deepspeed --stage 2
"""
import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time

for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[var] = "1"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HAS_SDPA = hasattr(F, "scaled_dot_product_attention")


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        if HAS_SDPA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
            y = att @ v
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln2(x))))


class SwiGLU(nn.Module):
    """An expert as torchspeed's: one fused [gate; up] projection, silu(gate) * up, down; no biases."""

    def __init__(self, d, f):
        super().__init__()
        self.fc, self.proj = nn.Linear(d, 2 * f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x):
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class MoEBlock(Block):
    """Block with DeepSpeed-MoE's layer as its MLP; the layer's auxiliary loss kept for the step."""

    def __init__(self, d, heads, experts, k, d_ff, ep):
        super().__init__(d, heads)
        from deepspeed.moe.layer import MoE  # noqa: E402

        del self.fc, self.mlp_proj
        self.moe = MoE(hidden_size=d, expert=SwiGLU(d, d_ff), num_experts=experts, ep_size=ep, k=k,
                       capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4, use_residual=False,
                       noisy_gate_policy=None, drop_tokens=True, use_rts=False)
        self.aux = None

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
        out, self.aux, _ = self.moe(self.ln2(x))
        return x + out


class GPT(nn.Module):
    def __init__(self, vocab, seq, d, layers, heads, moe=None):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList((MoEBlock(d, heads, **moe) if moe else Block(d, heads)) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.tok.weight.t()

    def aux_loss(self):
        """The MoE layers' load-balancing losses of the last forward, summed (0 for a dense GPT)."""
        return sum((b.aux for b in self.blocks if getattr(b, "aux", None) is not None), torch.zeros(()))


def save_llama(args):
    """A LlamaForCausalLM of the given shape, seeded, saved in fp32 (config.json, model.safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.d_ff,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads or args.heads, max_position_embeddings=args.seq,
                      rope_theta=args.rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(args.save_init)
    return 0


def main():
    p = argparse.ArgumentParser()
    for name, default in [("seq", 128), ("d_model", 192), ("layers", 4), ("heads", 6), ("micro", 16), ("steps", 5),
                          ("warmup", 2), ("stage", 2), ("vocab", 256)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--impl", choices=["ddp", "deepspeed"], default="ddp")
    p.add_argument("--arch", choices=["gpt", "llama", "moe"], default="gpt")
    for name, default in [("experts", 8), ("k", 2), ("ep", 1)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--init", default="", help="--arch llama: the Hugging Face folder to train from")
    p.add_argument("--save-init", default="", help="--arch llama: write a seeded LlamaForCausalLM here and exit")
    for name in ("kv_heads", "d_ff"):
        p.add_argument("--" + name, type=int, default=0)
    p.add_argument("--rope_theta", type=float, default=10000.0)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--nproc", type=int, default=0, help="start this many processes (0: run as one of them)")
    p.add_argument("--port", type=int, default=29630)
    args = p.parse_args()
    if args.save_init:
        return save_llama(args)
    if args.nproc > 0 and "RANK" not in os.environ:
        procs = []
        for r in range(args.nproc):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.nproc),
                       LOCAL_WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
            procs.append(subprocess.Popen([sys.executable] + sys.argv, env=env))
        codes = [proc.wait() for proc in procs]
        return max(codes)

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= world:  # one core per process, as torchspeed's launcher binds its ranks
        os.sched_setaffinity(0, {cores[rank * (len(cores) // world)]})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.arch == "llama":
        from transformers import LlamaForCausalLM  # noqa: E402

        hf = LlamaForCausalLM.from_pretrained(args.init, torch_dtype=torch.float32, attn_implementation="sdpa")
        hf.config.use_cache = False
        assert hf.config.vocab_size == args.vocab, (hf.config.vocab_size, args.vocab)

        class Logits(nn.Module):  # the logits, as GPT's forward returns them
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, idx):
                return self.m(input_ids=idx, use_cache=False).logits

        model = Logits(hf)
    elif args.arch == "moe":
        assert args.impl == "deepspeed", "--arch moe runs DeepSpeed-MoE (--impl deepspeed)"
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # noqa: E402

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # the MoE layer makes its groups
        model = GPT(args.vocab, args.seq, args.d_model, args.layers, args.heads,
                    moe={"experts": args.experts, "k": args.k, "d_ff": args.d_ff, "ep": args.ep})
    else:
        model = GPT(args.vocab, args.seq, args.d_model, args.layers, args.heads)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args.bf16 and args.impl == "ddp" else contextlib.nullcontext()
    if args.impl == "ddp":
        dist.init_process_group("gloo", rank=rank, world_size=world)
        engine = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        label = f"pytorch_{torch.__version__.split('+')[0]}_ddp_gloo" + ("_autocast_bf16" if args.bf16 else "")

        def train_step(x, y):
            with autocast:
                logits = engine(x)
            loss = F.cross_entropy(logits.reshape(-1, args.vocab).float(), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # noqa: E402

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        config = {
            "train_batch_size": args.micro * world,
            "train_micro_batch_size_per_gpu": args.micro,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": args.stage, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7},
            "steps_per_print": 10 ** 9,
            "wall_clock_breakdown": False,
        }
        if args.bf16:
            config["bf16"] = {"enabled": True}
        params = model.parameters()
        if args.arch == "moe":  # expert parameters in their own groups (reduced over the expert-data-parallel group)
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402

            params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                            "name": "parameters"})
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
        label = f"deepspeed_{deepspeed.__version__}_zero{args.stage}" + ("_bf16" if args.bf16 else "")
        if args.arch == "moe":
            label += f"_moe_ep{args.ep}"

        def train_step(x, y):
            loss = F.cross_entropy(engine(x).reshape(-1, args.vocab).float(), y.reshape(-1))
            if args.arch == "moe":
                loss = loss + 0.01 * model.aux_loss()
            engine.backward(loss)
            engine.step()

    gen = torch.Generator().manual_seed(rank)

    def batch():
        return (torch.randint(0, args.vocab, (args.micro, args.seq), generator=gen),
                torch.randint(0, args.vocab, (args.micro, args.seq), generator=gen))

    for _ in range(args.warmup):
        train_step(*batch())
    dist.barrier()
    start = time.perf_counter()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        train_step(*batch())
        times.append(time.perf_counter() - t0)
    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        tokens = args.micro * world * args.seq
        print(json.dumps({"impl": label, "torch": torch.__version__, "steps": args.steps, "seconds": seconds,
                          "step_seconds": times, "tokens_per_s": args.steps * tokens / seconds}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
