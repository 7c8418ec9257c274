// The serving kernels against independent references: the compact-weight linears (fp32, bf16,
// int8, 4-bit; widened, bf16 dot products, AMX tiles) against dense fp32 and exact double
// matmuls and against ggml's own 4-bit blocks, each row's bits the same in any batch; and the
// paged decode attention (fp32, bf16, int8 rows; grouped-query heads) against a softmax
// reference. The engine and model built on them: test_inference.cpp.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "torchspeed/checkpoint/gguf.h"
#include "torchspeed/checkpoint/gguf_writer.h"
#include "torchspeed/inference/attention.h"
#include "torchspeed/inference/linear.h"
#include "torchspeed/inference/linear_bf16.h"

using namespace torchspeed;
using namespace torchspeed::inference;

TEST(ServingLinear, CompactWeightsAndBatchInvariantRows) {
  torch::manual_seed(1);
  const at::Tensor w = at::randn({70, 45}), b = at::randn({70}), x = at::randn({40, 45});
  const at::Tensor ref = at::matmul(x, w.t()) + b;
  for (auto fmt : {WeightFormat::kFP32, WeightFormat::kBF16, WeightFormat::kInt8, WeightFormat::kQ4_0, WeightFormat::kQ4_1}) {
    ServingLinear l(w, b, fmt);
    const at::Tensor dense = at::matmul(x, l.dense_weight().t()) + b;  // what the format stores
    const at::Tensor y = l.forward(x, 0);  // 40 rows: GEMM path
    EXPECT_LT((y - dense).abs().max().item<double>(), 1e-4) << weight_format_name(fmt);
    const double tol = fmt == WeightFormat::kFP32 ? 1e-4 : fmt == WeightFormat::kBF16 ? 0.15 : fmt == WeightFormat::kInt8 ? 0.25 : 2.5;  // 4-bit: about 1 / 16 of a group's range
    EXPECT_LT((y - ref).abs().max().item<double>(), tol) << weight_format_name(fmt);
    // Row kernel: each row's bits are the same alone and among 16.
    const at::Tensor batch = l.forward(x.narrow(0, 0, 16), 16);
    EXPECT_LT((batch - dense.narrow(0, 0, 16)).abs().max().item<double>(), 1e-4);
    for (int64_t r : {0, 5, 15}) {
      EXPECT_TRUE(at::equal(l.forward(x.narrow(0, r, 1), 1)[0], batch[r])) << weight_format_name(fmt) << " row " << r;
    }
    // Mixed: the first 3 rows through the kernel, the rest through the GEMM.
    const at::Tensor mixed = l.forward(x, 3);
    EXPECT_TRUE(at::equal(mixed[1], batch[1]));
  }
  EXPECT_EQ(ServingLinear(w, b, WeightFormat::kBF16).weight_bytes(), 70 * 45 * 2 + 70 * 4);
  EXPECT_EQ(ServingLinear(w, b, WeightFormat::kInt8).weight_bytes(), 70 * 45 + 70 * 4 + 70 * 4);
  if (have_bf16_dot()) {  // 45 columns padded to 64: 32 bytes of nibbles and 2 fp16 scales a channel
    EXPECT_EQ(ServingLinear(w, b, WeightFormat::kQ4_0, true).weight_bytes(), 70 * 32 + 70 * 2 * 2 + 70 * 4);
    EXPECT_EQ(ServingLinear(w, b, WeightFormat::kQ4_1, true).weight_bytes(), 70 * 32 + 70 * 2 * 2 * 2 + 70 * 4);
  }
}

// Our 4-bit formats are ggml's Q4_0 and Q4_1: the numbers quantize_q4 packs for the kernels are
// those of the GGUF writer's blocks (quantize_row_q4_{0,1}_ref) as the GGUF reader decodes them,
// each rounded to bf16 (Note [4-bit weights]); a file's values quantize to themselves again.
TEST(ServingLinear, Q4MatchesGgmlQ4_0AndQ4_1) {
  torch::manual_seed(4);
  at::Tensor w = at::randn({6, 96});
  w[0].zero_();                  // d = 0 groups
  w[1][40] = 50.0f;              // one large positive value: d < 0 in Q4_0
  w.narrow(1, 64, 32)[2].fill_(-3.0f);  // a constant group
  namespace gg = torchspeed::checkpoint::gguf;
  for (const bool q4_1 : {false, true}) {
    const std::string what = q4_1 ? "Q4_1" : "Q4_0";
    const Q4Weights q = quantize_q4(w, q4_1);
    ASSERT_EQ(q.qs.sizes(), (std::vector<int64_t>{6, 64})) << what;  // 96 padded to 128
    ASSERT_EQ(q.d.sizes(), (std::vector<int64_t>{6, 4})) << what;
    ASSERT_EQ(q.m.defined(), q4_1);
    const at::Tensor ours = dequantize_q4(q, 96);
    const gg::Type type = q4_1 ? gg::Type::kQ4_1 : gg::Type::kQ4_0;
    const std::string bytes = gg::encode(type, w.data_ptr<float>(), w.numel());
    ASSERT_EQ(static_cast<int64_t>(bytes.size()), 6 * 3 * (q4_1 ? 20 : 18)) << what;
    at::Tensor ggml = at::empty({6, 96});
    gg::dequantize(static_cast<uint32_t>(type), reinterpret_cast<const uint8_t*>(bytes.data()), static_cast<int64_t>(bytes.size()),
                   w.numel(), ggml.data_ptr<float>(), "test");
    EXPECT_TRUE(at::equal(ours, ggml.to(at::kBFloat16).to(at::kFloat))) << what;
    EXPECT_TRUE(at::equal(ours[0], at::zeros({96}))) << what;
    EXPECT_TRUE(at::equal(ours[2].narrow(0, 64, 32), at::full({32}, -3.0f))) << what;
    // Half a step of the widest group (row 1's, with the 50), and the bf16 rounding.
    EXPECT_LT((ours - w).abs().max().item<float>(), (q4_1 ? 53.0f / 15 : 50.0f / 8) / 2 * 1.02f) << what;
    // Requantizing the decoded values gives the same blocks.
    const Q4Weights again = quantize_q4(ggml, q4_1);
    EXPECT_TRUE(at::equal(again.qs, q.qs)) << what;
    EXPECT_TRUE(at::equal(again.d, q.d)) << what;
    if (q4_1) {
      EXPECT_TRUE(at::equal(again.m, q.m));
    }
  }
  if (have_bf16_dot()) {  // 96 columns padded to 128: 64 bytes of nibbles and 4 fp16 scales (and minimums) a channel
    EXPECT_EQ(ServingLinear(w, at::Tensor(), WeightFormat::kQ4_0, true).weight_bytes(), 6 * (64 + 8));
    EXPECT_EQ(ServingLinear(w, at::Tensor(), WeightFormat::kQ4_1, true).weight_bytes(), 6 * (64 + 16));
  }
}

// forward_add adds bias and output into the residual inside the kernels, block by block; its
// bits must be those of forward() followed by residual.add_(), in every path: the row kernel,
// the GEMM for the rows past row_kernel_rows, and the bf16 dot products.
TEST(ServingLinear, ForwardAddIsForwardThenAdd) {
  torch::manual_seed(3);
  // Two threads (the suite runs with one), so that the GEMM rows' residual adds are split.
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  const at::Tensor w = at::randn({70, 45}), b = at::randn({70}), x = at::randn({40, 45}), res = at::randn({40, 70});
  for (auto fmt : {WeightFormat::kFP32, WeightFormat::kBF16, WeightFormat::kInt8, WeightFormat::kQ4_0, WeightFormat::kQ4_1}) {
    for (int kernel = 0; kernel < 3; ++kernel) {  // widened weights, VDPBF16PS, AMX (where present)
      const bool dot = kernel > 0;
      const ServingLinear l(w, b, fmt, dot, kernel == 2);
      for (int64_t n : {1, 2, 3, 16, 40}) {
        for (int64_t kernel_rows : {n, std::min<int64_t>(n, 3)}) {
          const std::string what = std::string(weight_format_name(fmt)) + " kernel " + std::to_string(kernel) + " rows " +
                                   std::to_string(n) + " kernel rows " + std::to_string(kernel_rows);
          at::Tensor expected = res.narrow(0, 0, n).clone();
          expected.add_(l.forward(x.narrow(0, 0, n), kernel_rows));
          at::Tensor fused = res.narrow(0, 0, n).clone();
          l.forward_add(x.narrow(0, 0, n), kernel_rows, fused);
          EXPECT_TRUE(at::equal(fused, expected)) << what;
        }
      }
    }
  }
  at::set_num_threads(threads);
}

TEST(ServingLinear, Bf16DotProductsRoundOnlyTheInput) {
  torch::manual_seed(2);
  if (!have_bf16_dot()) {
    // No AVX512-BF16: asking for bf16 dot products falls back to widening the weights to fp32.
    const at::Tensor w = at::randn({70, 45}), b = at::randn({70}), x = at::randn({5, 45});
    ServingLinear l(w, b, WeightFormat::kBF16, /*bf16_dot=*/true);
    EXPECT_FALSE(l.bf16_dot());
    EXPECT_FALSE(l.amx());
    EXPECT_TRUE(at::equal(l.forward(x, 5), ServingLinear(w, b, WeightFormat::kBF16, false).forward(x, 5)));
    return;
  }
  // VDPBF16PS everywhere; AMX tiles where the CPU has them (Note [AMX tiles]).
  for (bool amx : {false, true}) {
    if (amx && !have_amx()) continue;
    for (WeightFormat fmt : {WeightFormat::kBF16, WeightFormat::kInt8, WeightFormat::kQ4_0, WeightFormat::kQ4_1}) {
      if (amx && (fmt == WeightFormat::kQ4_0 || fmt == WeightFormat::kQ4_1)) continue;  // (4-bit weights stay off the tiles)
      for (int64_t K : {45, 64, 200}) {  // a masked tail, whole steps of 32 (and of AMX's 64), both
        const std::string what = std::string(weight_format_name(fmt)) + (amx ? " amx" : " dot") + " K " + std::to_string(K);
        const at::Tensor w = at::randn({70, K}), b = at::randn({70}), x = at::randn({40, K});
        ServingLinear l(w, b, fmt, /*bf16_dot=*/true, amx);
        ASSERT_TRUE(l.bf16_dot());
        ASSERT_EQ(l.amx(), amx);
        EXPECT_FALSE(ServingLinear(w, b, WeightFormat::kFP32, true).bf16_dot());
        // The input as the kernel rounds it: bf16, or with int8 weights on AMX, 16-bit fixed
        // point per row (q = round(x * (32767 / max|x|)), times max|x| / 32767).
        at::Tensor xin = x.to(at::kBFloat16).to(at::kDouble);
        if (amx && fmt == WeightFormat::kInt8) {
          const at::Tensor m = x.abs().amax(1, true);
          const at::Tensor q = (x * (at::full_like(m, 32767.0f) / m)).round();
          EXPECT_EQ(q.abs().max().item<float>(), 32767.0f);
          xin = q.to(at::kDouble) * (m / 32767.0f).to(at::kDouble);
        }
        // Exact products of that input and the stored weight (bf16, or int8 times its channel's
        // scale), summed without rounding: the kernels add in fp32 (or exactly, in integers).
        const at::Tensor wd = fmt == WeightFormat::kBF16 ? w.to(at::kBFloat16).to(at::kDouble) : l.dense_weight().to(at::kDouble);
        const at::Tensor ref = at::matmul(xin, wd.t()) + b.to(at::kDouble);
        const at::Tensor y = l.forward(x, 0);
        EXPECT_LT((y.to(at::kDouble) - ref).abs().max().item<double>(), 2e-5 * std::sqrt(static_cast<double>(K))) << what;
        EXPECT_EQ(l.forward(x.narrow(0, 0, 0), 0).sizes(), (std::vector<int64_t>{0, 70}));  // no rows
        // One kernel for every row count: a row's bits are the same alone, among 2, 3, 16, 17 or 40.
        for (int64_t r : {0, 1, 2, 13, 16, 39}) {
          const at::Tensor alone = l.forward(x.narrow(0, r, 1), 1)[0];
          EXPECT_TRUE(at::equal(alone, y[r])) << what << " row " << r;
          for (int64_t n : {2, 3, 4, 5, 16, 17}) {
            if (r < n) {
              EXPECT_TRUE(at::equal(alone, l.forward(x.narrow(0, 0, n), n)[r])) << what << " row " << r << " of " << n;
            }
          }
        }
        // A row of zeros gives the bias; a row holding inf gives NaN or inf, and only there
        // (3 rows: int8 on VPDPBUSD where the CPU has it; 20: on tiles).
        for (int64_t n : {3, 20}) {
          at::Tensor odd = x.narrow(0, 0, n).clone();
          odd[0].zero_();
          odd[1][K / 2] = std::numeric_limits<float>::infinity();
          const at::Tensor yo = l.forward(odd, n);
          EXPECT_TRUE(at::equal(yo[0], b)) << what << " of " << n;
          EXPECT_FALSE(at::isfinite(yo[1]).any().item<bool>()) << what << " of " << n;
          EXPECT_TRUE(at::equal(yo.narrow(0, 2, n - 2), y.narrow(0, 2, n - 2))) << what << " of " << n;
        }
      }
    }
  }
}

TEST(ServingLinear, GeluInsideTheKernel) {
  torch::manual_seed(5);
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  // Outputs from -12 to 12: both tails of erf and tanh, and the middle.
  const at::Tensor w = at::randn({70, 45}) * 1.5, b = at::randn({70}), x = at::randn({40, 45});
  for (auto fmt : {WeightFormat::kFP32, WeightFormat::kBF16, WeightFormat::kInt8, WeightFormat::kQ4_0, WeightFormat::kQ4_1}) {
    for (int kernel = 0; kernel < 3; ++kernel) {
      const ServingLinear l(w, b, fmt, kernel > 0, kernel == 2);
      for (const char* approx : {"none", "tanh"}) {
        const Activation act = activation_for_gelu(approx);
        const std::string what = std::string(weight_format_name(fmt)) + " kernel " + std::to_string(kernel) + " " + approx;
        for (int64_t kernel_rows : {int64_t{40}, int64_t{3}}) {  // the row kernel for all, and GEMM rows after 3
          const at::Tensor pre = l.forward(x, kernel_rows);
          const at::Tensor y = l.forward(x, kernel_rows, true, act);
          ASSERT_GT(pre.abs().max().item<float>(), 8.0f);
          const at::Tensor exact = at::gelu(pre.to(at::kDouble), approx);
          const at::Tensor err = (y.to(at::kDouble) - exact).abs() / pre.abs().to(at::kDouble).clamp_min(1.0);
          EXPECT_LT(err.max().item<double>(), 3e-7) << what;
          // Elementwise: a row of the row kernel gets the same bits alone.
          for (int64_t r : {int64_t{0}, int64_t{2}, kernel_rows - 1}) {
            EXPECT_TRUE(at::equal(l.forward(x.narrow(0, r, 1), 1, true, act)[0], y[r])) << what << " row " << r;
          }
        }
      }
    }
  }
  // Far out and at infinity, as at::gelu: y, -0, inf.
  const at::Tensor big = at::tensor({1e6f, -1e6f, 1e8f, -1e8f, 3e38f, -3e38f, std::numeric_limits<float>::infinity()});
  for (const char* approx : {"none", "tanh"}) {
    at::Tensor y = big.clone().unsqueeze(0);
    activate(y.data_ptr<float>(), 1, y.size(1), 0, y.size(1), activation_for_gelu(approx));
    EXPECT_TRUE(at::equal(y[0], at::gelu(big.to(at::kDouble), approx).to(at::kFloat))) << approx << ": " << y;
  }
  EXPECT_THROW(activation_for_gelu("erf"), std::exception);
  at::set_num_threads(threads);
}

TEST(DecodeAttention, MatchesAReferenceForEveryHeadDimAndLength) {
  torch::manual_seed(9);
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  const int64_t heads = 3, slots_n = 160;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t hd : {16, 32, 48, 64, 128, 256}) {
      // Scattered slots, as a block table gives them; lengths around the groups of 16 keys.
      const at::Tensor perm = at::randperm(slots_n, at::kLong);
      const at::Tensor keys = (at::randn({slots_n, heads, hd}) * 2).to(dtype), values = at::randn({slots_n, heads, hd}).to(dtype);
      for (int64_t L : {1, 15, 16, 17, 33, 150}) {
        const std::string what = std::string(dtype == at::kFloat ? "fp32" : "bf16") + " hd " + std::to_string(hd) + " L " +
                                 std::to_string(L);
        const at::Tensor slots = perm.narrow(0, 0, L).contiguous();
        const at::Tensor q = at::randn({2, heads, hd});  // two sequences at once
        at::Tensor out = at::full({2, heads, hd}, std::numeric_limits<float>::quiet_NaN());
        std::vector<DecodeAttentionItem> items;
        for (int64_t s = 0; s < 2; ++s) items.push_back({q[s].data_ptr<float>(), slots.data_ptr<int64_t>(), L, out[s].data_ptr<float>()});
        const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
        decode_attention(items.data(), 2, keys.data_ptr(), values.data_ptr(), dtype == at::kBFloat16 ? KVType::kBF16 : KVType::kFP32,
                         heads, heads, hd, scale);
        const at::Tensor K = keys.index_select(0, slots).to(at::kDouble).permute({1, 0, 2});  // [H, L, hd]
        const at::Tensor V = values.index_select(0, slots).to(at::kDouble).permute({1, 0, 2});
        for (int64_t s = 0; s < 2; ++s) {
          const at::Tensor att = at::matmul(K, q[s].to(at::kDouble).unsqueeze(2)).squeeze(2) * scale;  // [H, L]
          const at::Tensor ref = at::matmul(att.softmax(-1).unsqueeze(1), V).squeeze(1);           // [H, hd]
          EXPECT_LT((out[s].to(at::kDouble) - ref).abs().max().item<double>(), 2e-6) << what;
        }
      }
    }
  }
  at::set_num_threads(threads);
}

// An int8 cache: each (slot, KV head) row is q * scale; the kernel's output is attention over
// those values (scores from the dot product times the key's scale, values times theirs), for
// every head_dim the kernel dispatches and around its 16-key groups, with grouped-query heads.
TEST(DecodeAttention, Int8RowsWithTheirScales) {
  torch::manual_seed(11);
  const int64_t heads = 6, kv_heads = 2, slots_n = 80;
  for (int64_t hd : {16, 48, 64, 128, 40}) {  // 40: the portable loop
    const at::Tensor keys = at::randint(-127, 128, {slots_n, kv_heads, hd}).to(at::kChar);
    const at::Tensor values = at::randint(-127, 128, {slots_n, kv_heads, hd}).to(at::kChar);
    const at::Tensor ks = at::rand({slots_n, kv_heads}) * 0.05, vs = at::rand({slots_n, kv_heads}) * 0.05;
    for (int64_t L : {1, 16, 17, 70}) {
      const at::Tensor slots = at::randperm(slots_n, at::kLong).narrow(0, 0, L).contiguous();
      const at::Tensor q = at::randn({heads, hd});
      at::Tensor out = at::full({heads, hd}, std::numeric_limits<float>::quiet_NaN());
      DecodeAttentionItem item{q.data_ptr<float>(), slots.data_ptr<int64_t>(), L, out.data_ptr<float>()};
      const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
      decode_attention(&item, 1, keys.data_ptr(), values.data_ptr(), KVType::kInt8, heads, kv_heads, hd, scale,
                       ks.data_ptr<float>(), vs.data_ptr<float>());
      const at::Tensor Kd = (keys.to(at::kDouble) * ks.to(at::kDouble).unsqueeze(2)).index_select(0, slots);
      const at::Tensor Vd = (values.to(at::kDouble) * vs.to(at::kDouble).unsqueeze(2)).index_select(0, slots);
      const at::Tensor K = Kd.permute({1, 0, 2}).repeat_interleave(heads / kv_heads, 0);
      const at::Tensor V = Vd.permute({1, 0, 2}).repeat_interleave(heads / kv_heads, 0);
      const at::Tensor att = at::matmul(K, q.to(at::kDouble).unsqueeze(2)).squeeze(2) * scale;
      const at::Tensor ref = at::matmul(att.softmax(-1).unsqueeze(1), V).squeeze(1);
      EXPECT_LT((out.to(at::kDouble) - ref).abs().max().item<double>(), 2e-5) << "hd " << hd << " L " << L;
    }
  }
}

TEST(DecodeAttention, GroupedQueryHeadsReadTheirGroupsKVHead) {
  torch::manual_seed(10);
  const int64_t heads = 6, kv_heads = 2, hd = 64, slots_n = 40, L = 37;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor keys = at::randn({slots_n, kv_heads, hd}).to(dtype), values = at::randn({slots_n, kv_heads, hd}).to(dtype);
    const at::Tensor slots = at::randperm(slots_n, at::kLong).narrow(0, 0, L).contiguous();
    const at::Tensor q = at::randn({heads, hd});
    at::Tensor out = at::full({heads, hd}, std::numeric_limits<float>::quiet_NaN());
    DecodeAttentionItem item{q.data_ptr<float>(), slots.data_ptr<int64_t>(), L, out.data_ptr<float>()};
    const float scale = 0.125f;
    decode_attention(&item, 1, keys.data_ptr(), values.data_ptr(), dtype == at::kBFloat16 ? KVType::kBF16 : KVType::kFP32, heads,
                     kv_heads, hd, scale);
    // Hugging Face's repeat_kv: query head h uses KV head h / (heads / kv_heads).
    const at::Tensor K = keys.index_select(0, slots).to(at::kDouble).permute({1, 0, 2}).repeat_interleave(heads / kv_heads, 0);
    const at::Tensor V = values.index_select(0, slots).to(at::kDouble).permute({1, 0, 2}).repeat_interleave(heads / kv_heads, 0);
    const at::Tensor att = at::matmul(K, q.to(at::kDouble).unsqueeze(2)).squeeze(2) * scale;
    const at::Tensor ref = at::matmul(att.softmax(-1).unsqueeze(1), V).squeeze(1);
    EXPECT_LT((out.to(at::kDouble) - ref).abs().max().item<double>(), 2e-6);
  }
}
