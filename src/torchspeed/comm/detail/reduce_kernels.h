// Local reduction kernels for communication algorithms that reduce on the CPU (reduce-scatter
// by all-to-all, bf16/fp16 sums). Internal: not installed.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "torchspeed/comm/communicator.h"

namespace torchspeed::comm::detail {

// out[i] = pieces[0][i] (op) pieces[1][i] (op) ... (op) pieces[p-1][i] for i < n. Reduced left
// to right in rank order, so every rank gets the same bits; bf16/fp16 accumulate in fp32 and
// round once. kAvg divides the sum by p. `out` may alias any piece (element i is read from
// every piece before out[i] is written).
void reduce_pieces(at::ScalarType dtype, ReduceOp op, const void* const* pieces, int p, int64_t n,
                   void* out);

// data[i] /= divisor, in place (floating dtypes).
void divide_inplace(at::ScalarType dtype, void* data, int64_t n, int divisor);

}  // namespace torchspeed::comm::detail
