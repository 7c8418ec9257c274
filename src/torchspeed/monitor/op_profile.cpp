// RecordFunction observer that attributes operator time to GEMM, attention and the rest.
//
// Note [Operator categories]
// LibTorch wraps operators in RecordFunction scopes: aten::linear runs aten::addmm, an autograd
// node (MmBackward0) runs aten::mm, scaled_dot_product_attention runs its flash kernel. Each
// operator's exclusive time (its wall time less that of the operators it ran) goes to one
// category: anything inside an attention operator is attention (its GEMMs included: they are the
// attention's cost); otherwise a GEMM kernel is GEMM; everything else is "other" (element-wise,
// norms, softmax, embedding, copies, and the thin wrappers' own time). Only the calling threads'
// operators are seen; intra-op worker threads run inside their caller's operator, so their work
// is in that operator's wall time.
#include "torchspeed/monitor/op_profile.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "torchspeed/base/error.h"

namespace torchspeed::monitor {
namespace {

enum class Category { kGemm, kAttention, kOther };

Category classify(const char* name) {
  std::string n(name ? name : "");
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  if (n.find("attention") != std::string::npos) return Category::kAttention;
  static const char* kGemm[] = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv",
                                "aten::dot", "aten::mv", "aten::_addmm_activation"};
  for (const char* g : kGemm) {
    if (n == g) return Category::kGemm;
  }
  return Category::kOther;
}

struct Frame : at::ObserverContext {
  std::chrono::steady_clock::time_point start;
  const char* name = nullptr;
  double children_s = 0;
  Category category = Category::kOther;
};

thread_local std::vector<Frame*> t_stack;
std::mutex g_mu;
OpTimes* g_out = nullptr;  // guarded by g_mu; set while a Scope lives
std::atomic<bool> g_active{false};

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  auto f = std::make_unique<Frame>();
  const bool inside_attention = !t_stack.empty() && t_stack.back()->category == Category::kAttention;
  f->category = inside_attention ? Category::kAttention : classify(fn.name());
  f->name = fn.name();
  t_stack.push_back(f.get());
  f->start = std::chrono::steady_clock::now();
  return f;
}

void on_end(const at::RecordFunction&, at::ObserverContext* ctx) {
  auto* f = static_cast<Frame*>(ctx);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - f->start).count();
  // Operators finish in the order they started on a thread; a frame that is not on top (an
  // observer added mid-operator) is counted but not nested.
  if (!t_stack.empty() && t_stack.back() == f) t_stack.pop_back();
  if (!t_stack.empty()) t_stack.back()->children_s += wall;
  const double own = std::max(0.0, wall - f->children_s);
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_out) return;
  ++g_out->ops;
  switch (f->category) {
    case Category::kGemm: g_out->gemm_s += own; break;
    case Category::kAttention: g_out->attention_s += own; break;
    case Category::kOther:
      g_out->other_s += own;
      g_out->other_by_op[f->name ? f->name : "?"] += own;
      break;
  }
}

}  // namespace

OpTimeProfile::Scope::Scope(OpTimes& out) : out_(out) {
  TS_CHECK(!g_active.exchange(true), "OpTimeProfile: one profile scope at a time per process");
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_out = &out_;
  }
  handle_ = at::addGlobalCallback(at::RecordFunctionCallback(on_start, on_end)
                                      .needsInputs(false)
                                      .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

OpTimeProfile::Scope::~Scope() {
  at::removeCallback(handle_);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_out = nullptr;
  }
  g_active = false;
}

}  // namespace torchspeed::monitor
