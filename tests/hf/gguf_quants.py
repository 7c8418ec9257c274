#!/usr/bin/env python3
"""torchspeed's GGUF dequantization against the gguf package's (llama.cpp's own Python reader).

  gguf_quants.py make FILE.gguf
      A GGUF with a tensor of each type torchspeed reads: F32, F16, BF16, Q4_0, Q4_1, Q8_0 (from
      random values through gguf's quantizers) and Q4_K, Q5_K, Q6_K (random blocks: every bit
      pattern of the quants, scales and mins, with finite f16 super-scales), rows of 512 values.
  gguf_quants.py check FILE.gguf OURS.safetensors
      Each tensor of OURS (tests/hf/gguf_tensors.cpp) equals gguf.quants.dequantize of the
      file's bytes, bit for bit up to fp32 rounding (1e-6 relative).
"""
import sys

import numpy as np


def make(path):
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    rows, cols = 6, 512
    for qt in (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0):
        a = rng.standard_normal((rows, cols)).astype(np.float32) * 3
        if qt == Q.F32:
            w.add_tensor("t_%s" % qt.name, a)
        else:
            q = quantize(a, qt)
            w.add_tensor("t_%s" % qt.name, q, raw_shape=q.shape, raw_dtype=qt)
    for qt in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        block, size = gguf.GGML_QUANT_SIZES[qt]
        n_blocks = rows * cols // block
        raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
        # The f16 super-block scales: finite values of moderate size.
        scales = (rng.standard_normal((n_blocks, 2)) * 0.05).astype(np.float16).view(np.uint8).reshape(n_blocks, 4)
        if qt == Q.Q6_K:
            raw[:, size - 2:] = scales[:, :2]
        else:
            raw[:, :4] = scales
        w.add_tensor("t_%s" % qt.name, raw.reshape(rows, cols // block * size), raw_shape=(rows, cols // block * size),
                     raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("gguf_quants make: %s" % path)


def check(path, ours_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import load_file

    ours = load_file(ours_path)
    r = GGUFReader(path)
    bad = 0
    for t in r.tensors:
        ref = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(x) for x in t.shape]))).astype(np.float32)
        got = ours[t.name]
        diff = float(np.max(np.abs(got - ref) / np.maximum(1.0, np.abs(ref)))) if got.shape == ref.shape else float("inf")
        ok = diff <= 1e-6
        bad += not ok
        print("gguf_quants: %-8s %s %s max relative difference %.3g%s" % (
            t.tensor_type.name, got.shape, "==" if ok else "!=", diff, "" if ok else "  FAIL"))
    if bad:
        sys.exit(1)
    print("gguf_quants: all %d types equal the gguf package's dequantization" % len(r.tensors))


if __name__ == "__main__":
    {"make": lambda: make(sys.argv[2]), "check": lambda: check(sys.argv[2], sys.argv[3])}[sys.argv[1]]()
