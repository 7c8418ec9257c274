// Argument validation shared by every backend, the blocking forms of the ops, and helpers built
// on them.
#include "torchspeed/comm/communicator.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "torchspeed/base/error.h"

namespace torchspeed::comm {
namespace {

bool supported_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kBFloat16: case at::kHalf:
    case at::kInt: case at::kLong: case at::kByte:
      return true;
    default:
      return false;
  }
}

int64_t env_int64(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  double x = std::strtod(v, &end);
  TS_CHECK(end && *end == '\0' && x > 0, "environment variable ", name, "='", v,
           "' must be a positive number");
  return static_cast<int64_t>(x);
}

}  // namespace

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

std::chrono::milliseconds default_timeout() {
  const char* v = std::getenv("TORCHSPEED_COMM_TIMEOUT_S");
  if (!v || !*v) return std::chrono::minutes(10);
  char* end = nullptr;
  double s = std::strtod(v, &end);
  TS_CHECK(end && *end == '\0' && s > 0, "TORCHSPEED_COMM_TIMEOUT_S='", v,
           "' must be a positive number of seconds");
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000.0));
}

int64_t default_one_phase_bytes() {
  return env_int64("TORCHSPEED_COMM_ONE_PHASE_BYTES", 64 << 10);
}

int64_t default_chunk_bytes() { return env_int64("TORCHSPEED_COMM_CHUNK_BYTES", 1 << 20); }

int64_t default_segment_bytes() { return env_int64("TORCHSPEED_COMM_SEGMENT_BYTES", 1 << 20); }

std::string Communicator::describe(const char* op) const {
  return concat(op, " on group '", name(), "' (rank ", rank(), " of ", size(), ", world rank ",
             world_ranks().at(rank()), ")");
}

void Communicator::check_tensor(const char* op, const at::Tensor& t, const char* what) const {
  TS_CHECK(t.defined(), describe(op), ": ", what, " is an undefined tensor");
  TS_CHECK(t.device().is_cpu(), describe(op), ": ", what, " is on ", t.device(),
           "; the MPI communicator takes CPU tensors (move it with .cpu())");
  TS_CHECK(supported_dtype(t.scalar_type()), describe(op), ": ", what, " has dtype ",
           t.scalar_type(), "; supported: float32, float64, bfloat16, float16, int32, int64, uint8");
  TS_CHECK(t.is_contiguous(), describe(op), ": ", what,
           " is not contiguous (sizes ", t.sizes(), ", strides ", t.strides(),
           "); pass tensor.contiguous() and copy the result back");
}

void Communicator::check_reduce(const char* op, const at::Tensor& t, ReduceOp rop) const {
  TS_CHECK(rop != ReduceOp::kAvg || at::isFloatingType(t.scalar_type()), describe(op),
           ": ReduceOp avg needs a floating dtype, got ", t.scalar_type(),
           "; use sum and divide yourself");
}

void Communicator::check_peer(const char* op, int peer, const char* what) const {
  TS_CHECK(peer >= 0 && peer < size(), describe(op), ": ", what, " ", peer,
           " is not a rank of this group (0..", size() - 1, ")");
}

void Communicator::validate_all_reduce(const at::Tensor& t, ReduceOp op) const {
  check_tensor("all_reduce", t, "tensor");
  check_reduce("all_reduce", t, op);
}

void Communicator::validate_reduce_scatter(const at::Tensor& in, const at::Tensor& out,
                                           ReduceOp op) const {
  check_tensor("reduce_scatter", in, "input");
  check_tensor("reduce_scatter", out, "output");
  check_reduce("reduce_scatter", in, op);
  TS_CHECK(in.scalar_type() == out.scalar_type(), describe("reduce_scatter"),
           ": input dtype ", in.scalar_type(), " differs from output dtype ", out.scalar_type());
  TS_CHECK(in.numel() == out.numel() * size(), describe("reduce_scatter"), ": input has ",
           in.numel(), " elements but must hold ", size(), " equal chunks of the output's ",
           out.numel(), " (", out.numel() * size(), "); pad the input to a multiple of ", size());
  TS_CHECK(in.numel() == 0 || in.data_ptr() != out.data_ptr(), describe("reduce_scatter"),
           ": input and output must not share memory");
}

void Communicator::validate_all_gather(const at::Tensor& in, const at::Tensor& out) const {
  check_tensor("all_gather", in, "input");
  check_tensor("all_gather", out, "output");
  TS_CHECK(in.scalar_type() == out.scalar_type(), describe("all_gather"), ": input dtype ",
           in.scalar_type(), " differs from output dtype ", out.scalar_type());
  TS_CHECK(out.numel() == in.numel() * size(), describe("all_gather"), ": output has ",
           out.numel(), " elements but must hold ", size(), " x ", in.numel(), " = ",
           in.numel() * size());
}

void Communicator::validate_broadcast(const at::Tensor& t, int root) const {
  check_tensor("broadcast", t, "tensor");
  check_peer("broadcast", root, "root");
}

void Communicator::validate_p2p(const char* op, const at::Tensor& t, int peer, int tag) const {
  check_tensor(op, t, "tensor");
  check_peer(op, peer, op[0] == 's' ? "destination" : "source");
  TS_CHECK(peer != rank(), describe(op), ": a rank cannot ", op, " to/from itself");
  TS_CHECK(tag >= 0 && tag < (1 << 20), describe(op), ": tag must be in [0, 2^20), got ", tag);
}

WorkPtr Communicator::all_reduce_async(const at::Tensor& t, ReduceOp op) {
  validate_all_reduce(t, op);
  return do_all_reduce(t, op, Mode::kAsync);
}
WorkPtr Communicator::reduce_scatter_async(const at::Tensor& in, const at::Tensor& out,
                                           ReduceOp op) {
  validate_reduce_scatter(in, out, op);
  return do_reduce_scatter(in, out, op, Mode::kAsync);
}
WorkPtr Communicator::all_gather_async(const at::Tensor& in, const at::Tensor& out) {
  validate_all_gather(in, out);
  return do_all_gather(in, out, Mode::kAsync);
}
WorkPtr Communicator::broadcast_async(const at::Tensor& t, int root) {
  validate_broadcast(t, root);
  return do_broadcast(t, root, Mode::kAsync);
}
WorkPtr Communicator::send_async(const at::Tensor& t, int dst, int tag) {
  validate_p2p("send", t, dst, tag);
  return do_send(t, dst, tag);
}
WorkPtr Communicator::recv_async(const at::Tensor& t, int src, int tag) {
  validate_p2p("recv", t, src, tag);
  return do_recv(t, src, tag);
}
WorkPtr Communicator::barrier_async() { return do_barrier(Mode::kAsync); }

void Communicator::all_reduce(const at::Tensor& t, ReduceOp op) {
  validate_all_reduce(t, op);
  do_all_reduce(t, op, Mode::kBlocking)->wait();
}
void Communicator::reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op) {
  validate_reduce_scatter(in, out, op);
  do_reduce_scatter(in, out, op, Mode::kBlocking)->wait();
}
void Communicator::all_gather(const at::Tensor& in, const at::Tensor& out) {
  validate_all_gather(in, out);
  do_all_gather(in, out, Mode::kBlocking)->wait();
}
void Communicator::broadcast(const at::Tensor& t, int root) {
  validate_broadcast(t, root);
  do_broadcast(t, root, Mode::kBlocking)->wait();
}
void Communicator::all_to_all(const at::Tensor& input, const std::vector<int64_t>& send_counts,
                              const at::Tensor& output, const std::vector<int64_t>& recv_counts) {
  const char* op = "all_to_all";
  check_tensor(op, input, "input");
  check_tensor(op, output, "output");
  TS_CHECK(input.scalar_type() == output.scalar_type(), describe(op), ": input dtype ", input.scalar_type(),
           " differs from output dtype ", output.scalar_type());
  TS_CHECK(input.dim() >= 1 && output.dim() == input.dim() && input.sizes().slice(1) == output.sizes().slice(1),
           describe(op), ": input ", input.sizes(), " and output ", output.sizes(), " must have equal rows");
  const auto n = static_cast<size_t>(size());
  TS_CHECK(send_counts.size() == n && recv_counts.size() == n, describe(op), ": ", send_counts.size(), " send and ",
           recv_counts.size(), " receive counts for ", n, " ranks");
  int64_t sent = 0, received = 0;
  for (size_t j = 0; j < n; ++j) {
    TS_CHECK(send_counts[j] >= 0 && recv_counts[j] >= 0, describe(op), ": a negative count for rank ", j);
    sent += send_counts[j];
    received += recv_counts[j];
  }
  TS_CHECK(sent == input.size(0) && received == output.size(0), describe(op), ": the counts add up to ", sent, " sent and ",
           received, " received rows, but input has ", input.size(0), " and output ", output.size(0));
  std::vector<at::Tensor> in_blocks, out_blocks;
  for (size_t j = 0, a = 0, b = 0; j < n; a += send_counts[j], b += recv_counts[j], ++j) {
    in_blocks.push_back(input.narrow(0, static_cast<int64_t>(a), send_counts[j]));
    out_blocks.push_back(output.narrow(0, static_cast<int64_t>(b), recv_counts[j]));
  }
  const auto me = static_cast<size_t>(rank());
  TS_CHECK(send_counts[me] == recv_counts[me], describe(op), ": sends ", send_counts[me], " rows to itself but receives ",
           recv_counts[me]);
  // Receives first, then sends (MPI matches them in any order; posting receives first lets
  // eager messages land in place), peers in ring order from this rank so no pair waits on
  // another's.
  std::vector<WorkPtr> works;
  for (size_t k = 1; k < n; ++k) {
    const size_t src = (me + n - k) % n;
    if (recv_counts[src] > 0) works.push_back(recv_async(out_blocks[src], static_cast<int>(src), kAllToAllTag));
  }
  for (size_t k = 1; k < n; ++k) {
    const size_t dst = (me + k) % n;
    if (send_counts[dst] > 0) works.push_back(send_async(in_blocks[dst], static_cast<int>(dst), kAllToAllTag));
  }
  if (send_counts[me] > 0) out_blocks[me].copy_(in_blocks[me]);
  for (auto& w : works) w->wait();
}

void Communicator::send(const at::Tensor& t, int dst, int tag) { send_async(t, dst, tag)->wait(); }
void Communicator::recv(const at::Tensor& t, int src, int tag) { recv_async(t, src, tag)->wait(); }
void Communicator::barrier() { do_barrier(Mode::kBlocking)->wait(); }

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  const int n = comm.size();
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lens = at::empty({n}, at::kLong);
  comm.all_gather(len, lens);
  int64_t longest = 0;
  for (int i = 0; i < n; ++i) longest = std::max(longest, lens[i].item<int64_t>());
  at::Tensor buf = at::zeros({std::max<int64_t>(longest, 1)}, at::kByte);
  std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({n * buf.numel()}, at::kByte);
  comm.all_gather(buf, all);
  std::vector<std::string> out;
  const char* p = static_cast<const char*>(all.data_ptr());
  for (int i = 0; i < n; ++i) out.emplace_back(p + i * buf.numel(), static_cast<size_t>(lens[i].item<int64_t>()));
  return out;
}

}  // namespace torchspeed::comm
