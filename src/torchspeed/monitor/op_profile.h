// Where a step's time goes, by kind of LibTorch operator: GEMM, attention, everything else. A
// scope (OpTimeProfile::Scope) turns on a RecordFunction observer for the operators the process
// runs inside it, forward and backward, and adds up each operator's exclusive time (its own time
// less its children's) into a category. See Note [Operator categories] in op_profile.cpp.
#pragma once

#include <map>
#include <string>

namespace torchspeed::monitor {

struct OpTimes {
  double gemm_s = 0;       // mm, addmm, bmm, baddbmm, addmv, dot (and their backward nodes' GEMMs)
  double attention_s = 0;  // scaled_dot_product_attention and everything it runs, forward and backward
  double other_s = 0;      // every other operator: element-wise, norms, softmax, copies, embedding
  int64_t ops = 0;         // operators observed
  std::map<std::string, double> other_by_op;  // "other"'s exclusive seconds by operator name
  double total_s() const { return gemm_s + attention_s + other_s; }
};

class OpTimeProfile {
 public:
  // Observes operators from construction to destruction (one scope at a time per process) and
  // adds their times to `out`.
  class Scope {
   public:
    explicit Scope(OpTimes& out);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    OpTimes& out_;
    uint64_t handle_;
  };
};

}  // namespace torchspeed::monitor
