"""The peer of torchspeed's sequence-parallel training benchmark: DeepSpeed-Ulysses (ALST) on CPU.

Trains transformers' LlamaForCausalLM (SDPA attention, fp32, random init from --seed) on random
tokens, one sequence of --seq tokens per step (micro batch 1), with deepspeed.initialize (ZeRO
--stage, DeepSpeed's AdamW, --lr 1e-4, DeepSpeed's CPU accelerator over gloo) and --sp sequence-
parallel ranks (--nproc = --sp processes, data parallel 1), the way DeepSpeed's Arctic Long Sequence
Training (ALST) tutorial integrates Ulysses into a Hugging Face training loop:

  UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, micro_batch_size=1,
      seq_length=--seq, seq_length_is_variable=False)  swaps transformers' "sdpa" attention for the
      Ulysses wrapper (all-to-all from sequence shards to head shards and back) and returns the mpu
  deepspeed.initialize(..., mpu=mpu) with "sequence_parallel_size": sp in the config
  UlyssesSPDataLoaderAdapter  gives each rank its 1/sp shard of the sequence (input_ids,
      position_ids, pre-shifted labels "shift_labels")
  loss: model.loss_function(logits, shift_labels=...) on the shard, then the differentiable
      token-weighted average over the SP group (torch.distributed.nn.functional.all_gather), as the
      tutorial and ArcticTraining do

  --tiled-mlp   LlamaMLP.forward monkey-patched to DeepSpeed's TiledMLP (the tutorial's patch:
                ceil(seqlen / hidden) shards, agreed across ranks with an all_reduce MAX), or
                --mlp_shards shards
  --tiled-loss  logits + loss over --loss_shards slices of the sequence shard with DeepSpeed's
                sequence_tiled_compute (ArcticTraining's fused_logits_loss_fn: lm_head and loss per
                slice, sum reduction, then / good tokens); --loss_shards 0 is ArcticTraining's
                rule, ~1 GiB of fp32 logits a slice. TiledFusedLogitsLoss is not used: it runs the
                backward inside forward with an assumed incoming gradient of 1 and rescales only the
                hidden states' gradient by the true one, not lm_head's, so lm_head's gradient would be
                wrong under the cross-rank weighted average that Ulysses needs
  --sp 1        the same model, data and loss code trained plainly under DeepSpeed (no SP)

Gradient scale: the loss recipe above makes each rank's gradient sp x its shard's share (the
all_gather's backward sums the replicated loss's gradient over the SP group). ZeRO-3 (its default
reduce_scatter path) averages over the SP group and trains as --sp 1 does; ZeRO-1/2 divide by the
data-parallel size only (stage_1_and_2.py: dp_world_size / sequence_parallel_size), so their
gradients, and the reported "grad_norms", are sp x those of --sp 1 (DeepSpeed issue #5248). Adam
hides most of that, not all.

Sample k of the run (step k) is the same sequence whatever --sp is (rank r's loader yields global
samples r, r+sp, ...; the adapter hands step k the sample of rank k % sp), so the "losses" of runs
with different --sp should agree step for step.

Each process: one intra-op thread, OMP/MKL/OpenBLAS 1 thread, passive OpenMP waiting, its own core
where there are as many cores as processes (as benchmarks/peers_gpt.py). With --nproc N the script
starts its N processes itself with torchrun's environment variables (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT); their output goes to stderr and the script prints one JSON line on stdout:
  {"impl": "deepspeed-ulysses", "sp", "seq", "tokens_per_s", "step_s" (median), "peak_rss_bytes"
   (max over ranks of ru_maxrss * 1024), "loss" (last step's), ...}
or, when DeepSpeed fails, {"error": "<Type: the exception's first line>", "where", "rank", ...} with
exit status 0 (the first error a rank wrote: the others' are gloo's "Connection closed by peer").
Alone:
  .venv-bench/bin/python benchmarks/peers_ulysses.py --nproc 2 --sp 2 --seq 1024
"""
import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[var] = "1"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

IMPL = "deepspeed-ulysses"
OUT_ENV = "PEERS_ULYSSES_OUT"  # where a child writes its result or error JSON


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in [("vocab", 256), ("d_model", 128), ("n_layer", 2), ("n_head", 4), ("n_kv_head", 0),
                          ("d_ff", 512), ("seq", 1024), ("sp", 2), ("stage", 1), ("warmup", 1), ("steps", 2),
                          ("seed", 0), ("mlp_shards", 0), ("loss_shards", 0)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--rope_theta", type=float, default=10000.0)
    p.add_argument("--tie", action="store_true", help="tie the LM head to the embedding")
    p.add_argument("--tiled-mlp", dest="tiled_mlp", action="store_true", help="DeepSpeed's TiledMLP on the MLPs")
    p.add_argument("--tiled-loss", dest="tiled_loss", action="store_true",
                   help="logits + loss in slices with DeepSpeed's sequence_tiled_compute")
    p.add_argument("--nproc", type=int, default=0, help="start this many processes (0: run as one of them)")
    p.add_argument("--port", type=int, default=29640)
    p.add_argument("--timeout", type=float, default=1800.0, help="--nproc: give up on the processes after this")
    args = p.parse_args()
    args.n_kv_head = args.n_kv_head or args.n_head
    return args


def describe(args):
    return {"impl": IMPL, "sp": args.sp, "seq": args.seq, "stage": args.stage, "tiled_mlp": args.tiled_mlp,
            "tiled_loss": args.tiled_loss}


def error_record(args, exc, rank=None):
    lines = str(exc).strip().splitlines()
    rec = {"error": f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")}
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        rec["where"] = f"{tb[-1].filename}:{tb[-1].lineno}"
    if rank is not None:
        rec["rank"] = rank
    rec.update(describe(args))
    return rec


def launch(args):
    """Start --nproc ranks, print the one JSON line (rank 0's result, or the first error)."""
    if args.nproc != args.sp:
        print(json.dumps({"error": f"--nproc {args.nproc} must equal --sp {args.sp} (data parallel 1)",
                          **describe(args)}), flush=True)
        return 0
    tmp = tempfile.mkdtemp(prefix="peers_ulysses_")
    outs = [os.path.join(tmp, f"rank{r}.json") for r in range(args.nproc)]
    procs = []
    for r in range(args.nproc):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.nproc),
                   LOCAL_WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port),
                   **{OUT_ENV: outs[r]})
        # the ranks' own output (DeepSpeed's logs) goes to stderr: stdout carries only the JSON line
        procs.append(subprocess.Popen([sys.executable] + sys.argv, env=env, stdout=sys.stderr))
    deadline = time.monotonic() + args.timeout
    first_failed, failed_at = None, None
    while any(proc.poll() is None for proc in procs):
        for r, proc in enumerate(procs):
            if proc.returncode not in (None, 0) and first_failed is None:
                first_failed, failed_at = r, time.monotonic()
        # a failed rank leaves the others waiting in a collective: give them a moment to fail too, then stop them
        if (failed_at is not None and time.monotonic() - failed_at > 10) or time.monotonic() > deadline:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            break
        time.sleep(0.2)
    codes = [proc.wait() for proc in procs]
    if first_failed is None:
        first_failed = next((r for r, c in enumerate(codes) if c != 0), None)
    records, written = [], []
    for path in outs:
        try:
            with open(path) as f:
                records.append(json.load(f))
            written.append(os.stat(path).st_mtime_ns)
        except (OSError, ValueError):
            records.append(None)
            written.append(None)
    for path in outs:
        if os.path.exists(path):
            os.remove(path)
    os.rmdir(tmp)
    if first_failed is None and records[0] is not None and "error" not in records[0]:
        print(json.dumps(records[0]), flush=True)
        return 0
    # the first error written is the cause; the others' are usually gloo's "Connection closed by peer"
    failed = [r for r in range(args.nproc) if records[r] is not None and "error" in records[r]]
    err = records[min(failed, key=lambda r: written[r])] if failed else None
    if err is None:
        if time.monotonic() > deadline:
            err = {"error": f"timed out after {args.timeout:.0f} s", **describe(args)}
        else:
            r = first_failed if first_failed is not None else 0
            err = {"error": f"rank {r} exited with status {codes[r]}", "rank": r, **describe(args)}
    print(json.dumps(err), flush=True)
    return 0


def tiled_mlp_forward(mlp_shards):
    """The ALST tutorial's LlamaMLP.forward patch onto deepspeed's TiledMLP."""
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x):
        bs, seqlen, hidden = x.shape
        num_shards = mlp_shards or math.ceil(seqlen / hidden)
        # all ranks must run the same number of shards (ZeRO-3 would deadlock otherwise): take the max
        tensor = torch.tensor(num_shards, device=x.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        num_shards = tensor.item()
        compute_params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(mlp_forward, self, x, num_shards, compute_params)

    return forward


def tiled_logits_loss(model, hidden_states, shift_labels, loss_shards):
    """ArcticTraining's tiled logits + loss for one sequence shard: the mean over its good tokens."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    vocab = model.config.vocab_size
    bs, seqlen = shift_labels.shape
    num_shards = loss_shards or math.ceil(bs * seqlen * vocab * 4 / 2 ** 30)  # ~1 GiB of fp32 logits a slice

    def fused_logits_loss_fn(model_with_head=None, hidden_states=None, shift_labels=None, vocab_size=0):
        logits = model_with_head.lm_head(hidden_states)
        if bool((shift_labels == -100).all()):
            return (logits.sum() * 0.0).float()  # no token in this slice: a zero with the gradients' graph
        good = (shift_labels != -100).sum()
        loss = model_with_head.loss_function(logits=logits, labels=None, vocab_size=vocab_size,
                                             shift_labels=shift_labels)
        return loss * good

    total = sequence_tiled_compute(fused_logits_loss_fn, seqlen, num_shards,
                                   dict(hidden_states=hidden_states, shift_labels=shift_labels),
                                   dict(model_with_head=model, vocab_size=vocab), "hidden_states",
                                   [model.lm_head.weight], output_unshard_dimension=0, output_reduction="sum")
    return total / (shift_labels != -100).sum().clamp(min=1)


def worker(args):
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= world:  # one core per process, as torchspeed's launcher binds its ranks
        os.sched_setaffinity(0, {cores[rank * (len(cores) // world)]})
    torch.set_num_threads(1)
    if world != args.sp:
        raise ValueError(f"world size {world} must equal --sp {args.sp} (data parallel 1)")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import deepspeed  # noqa: E402
    import deepspeed.comm as dist  # noqa: E402
    import torch.distributed.nn.functional as dist_nn  # noqa: E402
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
    from transformers.models.llama import modeling_llama  # noqa: E402

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    if args.tiled_mlp:  # patched on the class, before the model is built, as the tutorial does
        modeling_llama.LlamaMLP.forward = tiled_mlp_forward(args.mlp_shards)

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.d_ff,
                      num_hidden_layers=args.n_layer, num_attention_heads=args.n_head,
                      num_key_value_heads=args.n_kv_head, max_position_embeddings=args.seq,
                      rope_theta=args.rope_theta, rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False,
                      tie_word_embeddings=args.tie, use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(torch.float32)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation

    mpu = None
    if args.sp > 1:
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=args.sp,
            micro_batch_size=1, seq_length=args.seq, seq_length_is_variable=False)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
        "zero_optimization": {"stage": args.stage},
        "sequence_parallel_size": args.sp,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    device = engine.device

    # rank r's loader yields global samples r, r + sp, ...; the adapter gives step k sample k for every --sp
    total = args.warmup + args.steps

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return math.ceil(total / args.sp)

        def __getitem__(self, i):
            gen = torch.Generator().manual_seed(args.seed * 1_000_003 + i * args.sp + rank)
            return torch.randint(0, args.vocab, (args.seq,), generator=gen)

    def collate(items):
        ids = items[0].unsqueeze(0)
        return {"input_ids": ids, "position_ids": torch.arange(args.seq).unsqueeze(0), "labels": ids.clone()}

    dl = torch.utils.data.DataLoader(Tokens(), batch_size=1, collate_fn=collate)
    if args.sp > 1:
        sp_group = mpu.get_sequence_parallel_group()
        batches = iter(UlyssesSPDataLoaderAdapter(dl, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=sp_group,
                                                  sp_world_size=args.sp, device=device))
    else:
        sp_group = None

        def plain():  # the adapter's label shift, without sharding
            for batch in dl:
                labels = torch.nn.functional.pad(batch.pop("labels"), (0, 1), value=-100)
                batch["shift_labels"] = labels[..., 1:].contiguous()
                yield batch

        batches = plain()

    hf = engine.module

    def train_step():
        batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in next(batches).items()}
        shift_labels = batch.pop("shift_labels")
        if args.tiled_loss:
            hidden = hf.model(**batch, use_cache=False).last_hidden_state
            loss = tiled_logits_loss(hf, hidden, shift_labels, args.loss_shards)
        else:
            logits = engine(**batch, use_cache=False).logits
            loss = hf.loss_function(logits=logits, labels=None, shift_labels=shift_labels,
                                    vocab_size=hf.config.vocab_size)
        if args.sp > 1:  # differentiable token-weighted average of the shards' losses over the SP group
            losses = dist_nn.all_gather(loss, group=sp_group)
            good = (shift_labels != -100).view(-1).sum()
            goods = dist_nn.all_gather(good, group=sp_group)
            loss = sum(losses[r] * goods[r] for r in range(args.sp)) / max(sum(goods), 1)
        engine.backward(loss)
        engine.step()
        norm = engine.get_global_grad_norm()
        grad_norms.append(float(norm) if norm is not None else None)
        return loss.item()

    grad_norms = []
    losses = [train_step() for _ in range(args.warmup)]
    dist.barrier()
    times = []
    start = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        losses.append(train_step())
        times.append(time.perf_counter() - t0)
    dist.barrier()
    seconds = time.perf_counter() - start
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.int64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    result = {"impl": IMPL, "sp": args.sp, "seq": args.seq,
              "tokens_per_s": args.steps * args.seq / seconds if args.steps else 0.0,
              "step_s": statistics.median(times) if times else 0.0, "peak_rss_bytes": int(rss.item()),
              "loss": losses[-1] if losses else None,
              "losses": losses, "grad_norms": grad_norms, "step_seconds": times, "stage": args.stage,
              "tiled_mlp": args.tiled_mlp,
              "tiled_loss": args.tiled_loss, "torch": torch.__version__, "deepspeed": deepspeed.__version__}
    dist.barrier()
    dist.destroy_process_group()
    return rank, result


def emit(rec, rank):
    out = os.environ.get(OUT_ENV)
    if out:
        with open(out, "w") as f:
            json.dump(rec, f)
    elif rank == 0 or "error" in rec:
        print(json.dumps(rec), flush=True)


def main():
    args = parse_args()
    if args.nproc > 0 and "RANK" not in os.environ:
        return launch(args)
    rank = int(os.environ.get("RANK", "0"))
    try:
        rank, result = worker(args)
    except Exception as exc:  # noqa: BLE001 - the bench shows DeepSpeed's error instead of a number
        traceback.print_exc(file=sys.stderr)
        emit(error_record(args, exc, rank), rank)
        return 1 if os.environ.get(OUT_ENV) else 0
    emit(result, rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
