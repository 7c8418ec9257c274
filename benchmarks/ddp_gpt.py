"""PyTorch DistributedDataParallel baseline for `torchspeed bench train`.

Trains the same GPT as torchspeed's models::GPT (pre-LN blocks, tied LM head) with DDP over gloo
on 2 local processes, one intra-op thread each, fp32 AdamW, random tokens, and prints one JSON
line with the measured tokens per second. Uses Debian's python3-torch (run with /usr/bin/python3).
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


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
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        x = x + self.attn_proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, seq, d, layers, heads):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.tok.weight.t()


def worker(rank, args, port, queue):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = GPT(256, args.seq, args.d, args.layers, args.heads)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro = args.batch // 2
    gen = torch.Generator().manual_seed(rank)

    def step():
        x = torch.randint(0, 256, (micro, args.seq), generator=gen)
        loss = F.cross_entropy(ddp(x).reshape(-1, 256), torch.randint(0, 256, (micro * args.seq,), generator=gen))
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    seconds = time.perf_counter() - t0
    if rank == 0:
        queue.put({"impl": "pytorch_ddp_gloo", "steps": args.steps, "seconds": seconds,
                   "tokens_per_s": args.steps * args.batch * args.seq / seconds})
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    for name, default in [("seq", 128), ("d", 192), ("layers", 4), ("heads", 6), ("batch", 32), ("steps", 5), ("warmup", 2)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--port", type=int, default=29517)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(worker, args=(args, args.port, queue), nprocs=2, join=True)
    print(json.dumps(queue.get()))


if __name__ == "__main__":
    main()
