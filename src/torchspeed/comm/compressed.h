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


}  // namespace torchspeed::comm
