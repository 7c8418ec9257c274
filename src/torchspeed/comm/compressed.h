// DeepSpeed's 1-bit compressed all-reduce (deepspeed/runtime/comm/{mpi,nccl,compressed}.py), the
// communication of the 1-bit optimizers: each rank sends one sign bit per element and one scale,
// with error feedback so that what compression drops is added back the next time.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "torchspeed/comm/communicator.h"

namespace torchspeed::comm {

// Note [1-bit all-reduce]
// With N ranks and the buffer padded to L elements (a multiple of N * lcm(N, 8), so each rank's
// chunk of C = L / N elements packs into whole bytes):
//  1. worker: x = buffer + e_w; s_w = ||x|| / sqrt(L); e_w = x - s_w sgn(x) (sgn(0) = +1). The
//     sign bits of chunk j go to rank j (an all-to-all of L / 8 bytes), the scales to everyone.
//  2. server (rank r, for chunk r): y = sum_j (s_w[j] / N) sgn_j + e_s; s_s = ||y|| / sqrt(C);
//     e_s = y - s_s sgn(y). Its sign bits and scale are all-gathered.
//  3. every rank: chunk r of the result = s_s[r] sgn(y_r), the same bits everywhere.
// A rank sends about 2 L / 8 bytes instead of 2 x 4 L for a ring all-reduce of fp32: 1/32. Sign
// bits are packed most significant bit first (numpy's packbits, as DeepSpeed's), bit 1 for x >= 0.
class OneBitAllReduce {
 public:
  // For buffers of `numel` fp32 elements over `comm` (the data-parallel group).
  OneBitAllReduce(CommunicatorPtr comm, int64_t numel);

  // Replaces `buffer` (fp32, contiguous, numel elements) by its compressed average over the
  // group, identical on every rank. Collective.
  void run(const at::Tensor& buffer);
  // Forgets the compression errors (DeepSpeed does not checkpoint them: a load resets them).
  void reset_errors();

  int64_t padded_numel() const { return padded_; }
  const at::Tensor& worker_error() const { return worker_error_; }
  const at::Tensor& server_error() const { return server_error_; }

 private:
  CommunicatorPtr comm_;
  int64_t numel_, padded_, chunk_;
  at::Tensor worker_error_;  // [padded] fp32
  at::Tensor server_error_;  // [chunk] fp32
};

// Note [Quantized reduce-scatter] (ZeRO++ qgZ, `zero_quantized_gradients`)
// DeepSpeed's qgZ replaces the gradients' reduce-scatter by all-to-alls of 4-bit blocks,
// quantizing both within and across nodes. Here the slow link alone is quantized: over H hosts
// of L ranks (Note [Hierarchical collectives]: consecutive ranks, the same count per host),
//  1. within each host, in fp32 (shared memory: it is not the bottleneck), for each host h a
//     reduce_scatter of block h gives local rank l the host's sum of chunk (h, l);
//  2. across hosts, among the ranks of local index l: row h of those sums is quantized, in blocks
//     of kBlock elements, to signed 4-bit integers (-7..7, round to nearest) with one fp32 scale
//     (max |x| / 7) per block, and sent to host h; each rank adds the rows it receives, decoded,
//     to its own row, which never leaves it and stays exact.
// A group that is not laid out in hosts (one host, or uneven) runs step 2 alone over all its
// ranks. Each rank sends (H-1) c (1/2 + 4/kBlock) bytes across hosts instead of (H-1) c 4: 7.5x
// less. The error of an element is at most sum over the other hosts of scale/2 of its block;
// every chunk is computed by one rank, so nothing has to agree across ranks. A block holding inf
// or NaN decodes to NaN (an fp16 overflow stays visible to the loss scaler).
class QuantizedReduceScatter {
 public:
  static constexpr int64_t kBlock = 128;
  explicit QuantizedReduceScatter(CommunicatorPtr comm);

  // out (c elements) = chunk `rank` of the sum (or average) over the group of `in` (size x c
  // elements); fp32, contiguous. Collective, blocking.
  void run(const at::Tensor& in, const at::Tensor& out, ReduceOp op);
  // The same, started: the intra-host stage runs on the communicator's engine, and polling the
  // Work (is_completed) moves the op to its next stage when the one in flight is done, so a caller
  // that polls while it computes overlaps the transfer. in and out must stay untouched until it
  // completes. Ops started one after the other must be completed in that order.
  WorkPtr run_async(const at::Tensor& in, const at::Tensor& out, ReduceOp op);
  int hosts() const { return hosts_; }
  // Bytes of one quantized row of c elements (scales, then two values per byte).
  static int64_t wire_bytes(int64_t c) { return 4 * ((c + kBlock - 1) / kBlock) + (c + 1) / 2; }
  // Quantizes x (n floats) into wire_bytes(n) bytes, and adds what such bytes decode to into y.
  static void encode(const float* x, int64_t n, uint8_t* wire);
  static void decode_add(const uint8_t* wire, int64_t n, float* y);

 private:
  CommunicatorPtr comm_, intra_, inter_;  // intra_ null when the group is not laid out in hosts
  int hosts_ = 1, local_ = 1;
};

// Note [Quantized all-gather] (ZeRO++ qwZ, `zero_quantized_weights`)
// DeepSpeed's qwZ all-gathers stage 3's parameter shards as int8 with one scale per group of a few
// thousand elements (symmetric: q = round(x / s), s = max |x| / 127). Here each shard of n
// elements is cut into blocks of kBlock and sent as wire_bytes(n) bytes: the fp32 scales, then one
// int8 per element, padded to 4 bytes (a rank's row keeps its scales aligned in the gathered
// buffer). Every rank decodes every row, its own too, so all ranks compute with the same values.
// The error of an element is at most half its block's scale; a block holding inf or NaN decodes
// to NaN. 4 bytes per fp32 element become about 1 + 4 / kBlock: 3.99x less (bf16: 1.99x).
struct Int8Blocks {
  static constexpr int64_t kBlock = 2048;
  static int64_t wire_bytes(int64_t n) { return (4 * ((n + kBlock - 1) / kBlock) + n + 3) / 4 * 4; }
  // x: n elements, fp32 or bf16, contiguous; wire: wire_bytes(n) bytes, 4-byte aligned.
  static void encode(const at::Tensor& x, uint8_t* wire);
  // Writes the n values the bytes decode to into out (fp32 or bf16, contiguous, n elements).
  static void decode(const uint8_t* wire, const at::Tensor& out);
};

}  // namespace torchspeed::comm
