// Note [AMX tiles]
// VDPBF16PS (Note [bf16 dot products]) does 32 multiply-adds per instruction; on Intel CPUs
// that issue it on one port, 16 decode rows ran no faster than fp32 FMAs (98 GFLOP/s on 2
// cores here, oneDNN's AMX matmul 407). AMX multiplies a 16-row tile of activations by a tile of
// weights into a 16 x 16 tile of accumulators in one instruction (8192 bf16 or 16384 int8
// multiply-adds). The weights are stored once in B-tile order (`amx_pack`: 1 KB tiles of 16
// channels, a 16-channel strip's tiles one after the other along k), so a thread streams its
// channels as one contiguous read, two strips side by side. A tile configured with fewer rows
// loads only those, but a tile product takes as long for 1 row as for 16 (about 19 ns here,
// whatever the rows; a tile load from L1 about 10 ns).
//
// bf16 weights (TDPBF16PS): the activations are rounded to bf16 as in the dot-product path;
// each output is one fp32 accumulator, zeroed, then one instruction per 32 k in order.
//
// int8 weights (TDPBSSD/TDPBUSD): widening int8 to bf16 costs more than the product (5 vector
// instructions per 32 weights, about 35 ns per 1 KB tile on one core here, as long as
// streaming the tile), and a tile can only be loaded from memory, so widened weights would also
// make a round trip through the store buffer. The activations are made integers instead: each
// row is scaled to 16-bit fixed point, q = round(x * 32767 / max|x|) (round to nearest even,
// in fp32), and split into a signed high byte and an unsigned low byte, q = 256 h + l. Two
// integer tile products, h by w and l by w, accumulate in int32 exactly (at most 128 * 127 * K
// and 255 * 127 * K: exact up to K of 66,000), and y = (256 H + L) * (max|x| / 32767) * scale
// is rounded once to fp32. The fixed point keeps each element to within max|x| / 65534, bf16 to
// within |x| / 256 at worst: the fixed point is the finer for every element above about
// max|x| / 256, and the sum adds no rounding.
//
// int8 weights for up to kVnniRows rows (a decode step's usual batch): two tile products per
// 1 KB of weights held one row to 13 GB/s per core, below the memory's rate (a batch-1 int8 step
// at 61% of its bandwidth limit). VPDPBUSD over the same packed weights computes the same exact
// integer sums in a fraction of the time (int8_vnni_pass), so the step is bound by the weight
// stream again.
//
// Every output (row, channel) depends only on its row and channel: the hardware computes a row
// of the accumulator tile from that row of the activation tile alone, the integer sums are
// exact (on tiles or VPDPBUSD alike), and the fixed-point scale is the row's own. So a row gets
// the same bits alone, in a batch of 16 or inside a prompt chunk. A CPU with AMX uses these
// kernels for every row count (mixing them with VDPBF16PS for some counts would change bf16 bits
// with the batch); one without uses the dot products.
#include "torchspeed/inference/linear_amx.h"

#include <ATen/ATen.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
// GCC 12 warns about the "undefined" vectors inside its own AVX-512 headers (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "torchspeed/inference/blocks.h"
#include "torchspeed/inference/simd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "torchspeed/base/error.h"

namespace torchspeed::inference {

bool have_amx() {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!have_bf16_dot() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool amx_bf16 = (d >> 22) & 1u, amx_tile = (d >> 24) & 1u, amx_int8 = (d >> 25) & 1u;
    if (!amx_bf16 || !amx_tile || !amx_int8) return false;
    // Linux hands out the 8 KB of tile state only to processes that ask (since 5.16).
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return yes;
}

at::Tensor amx_pack(const at::Tensor& w) {
  TS_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kChar),
           "amx_pack: expects a 2-D bf16 or int8 weight, got ", w.scalar_type(), " ", w.sizes());
  const int64_t g = w.scalar_type() == at::kChar ? 4 : 2;  // k per 4-byte B-tile element
  const int64_t N = w.size(0), K = w.size(1), NT = (N + 15) / 16, KT = (K + 16 * g - 1) / (16 * g);
  at::Tensor p = at::zeros({NT * 16, KT * 16 * g}, w.options());
  p.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  // [strip, channel, k tile, k group, g] -> [strip, k tile, k group, channel, g]
  return p.view({NT, 16, KT, 16, g}).permute({0, 2, 3, 1, 4}).contiguous();
}

at::Tensor amx_unpack(const at::Tensor& packed, int64_t N, int64_t K) {
  const int64_t NT = packed.size(0), KT = packed.size(1), g = packed.size(4);
  return packed.permute({0, 3, 1, 2, 4}).reshape({NT * 16, KT * 16 * g}).narrow(0, 0, N).narrow(1, 0, K).contiguous();
}

namespace {

#define TS_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16,amx-int8")))
#define TS_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

constexpr int64_t kTile = 512;  // bf16 (or int8) elements in a B tile

// Palette 1, every tile 64 bytes wide: tiles 0-5 (accumulators and activations) have the rows
// given, 6-7 (weights) 16. A tile of fewer rows loads and stores only those.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// Loads the configuration `rows` (of tiles 0-5) unless it is the one loaded last.
class Tiles {
 public:
  TS_AMX void use(const std::array<uint8_t, 6>& rows) {
    if (loaded_ && rows == rows_) return;
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = t < 6 ? rows[static_cast<size_t>(t)] : 16;
    }
    _tile_loadconfig(&c);
    rows_ = rows;
    loaded_ = true;
  }
  TS_AMX ~Tiles() {
    if (loaded_) _tile_release();
  }

 private:
  std::array<uint8_t, 6> rows_{};
  bool loaded_ = false;
};

// Tiles ahead that the bf16 tiles (one or two rows) and the int8 VPDPBUSD path request with
// prefetch: 6 KB, as the other kernels.
constexpr int64_t kAheadTiles = 6;

// c [32 x 32] fp32 (row stride 32) = MT row tiles of a (bf16, row stride lda elements) times NT
// channel strips of b (the second `strip` elements after the first), over KT k tiles.
template <int MT, int NT, bool Prefetch>
TS_AMX void tile_pass(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t strip, int64_t KT, float* c) {
  const int64_t lda_bytes = lda * 2;
  const uint16_t* a1 = a + 16 * lda;
  const uint16_t* b1 = b + strip;
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if constexpr (MT == 2) {
    _tile_zero(2);
    if constexpr (NT == 2) _tile_zero(3);
  }
  for (int64_t kt = 0; kt < KT; ++kt) {
    if constexpr (Prefetch) {
      simd::prefetch_lines(reinterpret_cast<const char*>(b + (kt + kAheadTiles) * kTile), 2 * kTile);
      if constexpr (NT == 2) simd::prefetch_lines(reinterpret_cast<const char*>(b1 + (kt + kAheadTiles) * kTile), 2 * kTile);
    }
    _tile_loadd(4, a + kt * 32, lda_bytes);
    _tile_loadd(6, b + kt * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) {
      _tile_loadd(7, b1 + kt * kTile, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MT == 2) {
      _tile_loadd(5, a1 + kt * 32, lda_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  if constexpr (NT == 2) _tile_stored(1, c + 16, 128);
  if constexpr (MT == 2) {
    _tile_stored(2, c + 16 * 32, 128);
    if constexpr (NT == 2) _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

template <bool Prefetch>
TS_AMX void pass(int mt, int nt, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t strip, int64_t KT, float* c) {
  if (mt == 2 && nt == 2) tile_pass<2, 2, Prefetch>(a, lda, b, strip, KT, c);
  else if (mt == 2) tile_pass<2, 1, Prefetch>(a, lda, b, strip, KT, c);
  else if (nt == 2) tile_pass<1, 2, Prefetch>(a, lda, b, strip, KT, c);
  else tile_pass<1, 1, Prefetch>(a, lda, b, strip, KT, c);
}

// Copies the C tiles' rows [m0, m0 + 32) x channels [o, o + 32) that exist into y.
template <class Value>
void copy_out(int64_t rows, int64_t m0, int64_t o, int64_t o1, int64_t N, float* y, const Value& value) {
  const int64_t rc = std::min<int64_t>(32, rows - m0), oc = std::min<int64_t>(32, o1 - o);
  for (int64_t r = 0; r < rc; ++r) {
    float* yr = y + (m0 + r) * N + o;
    for (int64_t j = 0; j < oc; ++j) yr[j] = value(r, j);
  }
}

// bf16 weights, output channels [o0, o1) (o0 a multiple of 16) for every row: channel strips
// two at a time, each pair passed over by the row tiles two at a time.
TS_AMX void bf16_block(const uint16_t* xa, int64_t rows, int64_t Kp, const uint16_t* w, int64_t o0,
                       int64_t o1, float* y, int64_t N) {
  const int64_t KT = Kp / 32, strip = KT * kTile;
  alignas(64) float c[32 * 32];
  Tiles tiles;
  for (int64_t o = o0; o < o1; o += 32) {
    const int nt = o + 16 < o1 ? 2 : 1;
    const uint16_t* b = w + (o / 16) * strip;
    for (int64_t m0 = 0; m0 < rows; m0 += 32) {
      const int mt = m0 + 16 < rows ? 2 : 1;
      // accumulators C[0][*] (0, 1) and activations 4: the first row tile; 2, 3 and 5: the second
      const auto r0 = static_cast<uint8_t>(std::min<int64_t>(16, rows - m0));
      const auto r1 = static_cast<uint8_t>(std::clamp<int64_t>(rows - m0 - 16, 1, 16));
      tiles.use({r0, r0, r1, r1, r0, r1});
      if (rows <= 2) pass<true>(mt, nt, xa + m0 * Kp, Kp, b, strip, KT, c);
      else pass<false>(mt, nt, xa + m0 * Kp, Kp, b, strip, KT, c);
      copy_out(rows, m0, o, o1, N, y, [&](int64_t r, int64_t j) { return c[r * 32 + j]; });
    }
  }
}

// int8 weights: the activations as 16-bit fixed point per row, q = h * 256 + l with a signed
// high byte h and an unsigned low byte l (Note [AMX tiles]).
// For the VNNI path (`biased`), the high bytes are stored as h + 128 (unsigned).
struct FixedRows {
  std::vector<uint8_t> hi;  // h, or h + 128 when biased
  std::vector<uint8_t> lo;
  std::vector<float> step;  // x ~ q * step, per row
  bool biased = false;
};

// One row into hi and lo, which arrive holding the fixed point of 0 (so k from K to Kp stays 0):
// step = max|x| / 32767, q = x * (32767 / max|x|) rounded to nearest even, in fp32; the high
// byte xor `bias` (0, or 0x80 for h + 128). A row of zeros has step 0; a row with inf or NaN gets
// step NaN, so its outputs are NaN.
TS_AMX void fix_row(const float* x, int64_t K, uint8_t* hi, uint8_t* lo, float* step, uint8_t bias) {
  // The maximum, and x * 0 summed: NaN exactly when some element is inf or NaN (max_ps drops NaN).
  __m512 mx = _mm512_setzero_ps(), bad = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_loadu_ps(x + k);
    mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
    bad = _mm512_add_ps(bad, _mm512_mul_ps(v, _mm512_setzero_ps()));
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1u);
  if (k < K) {
    const __m512 v = _mm512_maskz_loadu_ps(tail, x + k);
    mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
    bad = _mm512_add_ps(bad, _mm512_mul_ps(v, _mm512_setzero_ps()));
  }
  float m = _mm512_reduce_max_ps(mx);
  if (_mm512_cmp_ps_mask(bad, bad, _CMP_UNORD_Q) != 0) m = std::numeric_limits<float>::quiet_NaN();
  if (!(m > 0.0f) || !std::isfinite(m)) {
    *step = m == 0.0f ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    return;
  }
  *step = m / 32767.0f;
  const __m512 inv = _mm512_set1_ps(32767.0f / m);
  auto put = [&](int64_t at, __m512 v, __mmask16 msk) TS_AMX {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));  // round to nearest even
    const __m512i h = _mm512_xor_si512(_mm512_srai_epi32(q, 8), _mm512_set1_epi32(bias));
    _mm_mask_storeu_epi8(hi + at, msk, _mm512_cvtepi32_epi8(h));
    _mm_mask_storeu_epi8(lo + at, msk, _mm512_cvtepi32_epi8(_mm512_and_si512(q, _mm512_set1_epi32(255))));
  };
  for (k = 0; k + 16 <= K; k += 16) put(k, _mm512_loadu_ps(x + k), static_cast<__mmask16>(0xFFFF));
  if (k < K) put(k, _mm512_maskz_loadu_ps(tail, x + k), tail);
}

// c_hi, c_lo [16 x 32] int32 (row stride 32) = one row tile of the high and low bytes times NT
// int8 channel strips, over KT tiles of 64 k. The low bytes are unsigned (TDPBUSD).
template <int NT>
TS_AMX void int8_pass(const int8_t* hi, const uint8_t* lo, int64_t lda, const int8_t* b, int64_t strip, int64_t KT,
                      int32_t* c_hi, int32_t* c_lo) {
  const int8_t* b1 = b + strip;
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (NT == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t kt = 0; kt < KT; ++kt) {
    _tile_loadd(4, hi + kt * 64, lda);
    _tile_loadd(5, lo + kt * 64, lda);
    _tile_loadd(6, b + kt * 2 * kTile, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbusd(2, 5, 6);
    if constexpr (NT == 2) {
      _tile_loadd(7, b1 + kt * 2 * kTile, 64);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbusd(3, 5, 7);
    }
  }
  _tile_stored(0, c_hi, 128);
  _tile_stored(2, c_lo, 128);
  if constexpr (NT == 2) {
    _tile_stored(1, c_hi + 16, 128);
    _tile_stored(3, c_lo + 16, 128);
  }
}

// One to kVnniRows rows over the same packed int8 weights with VPDPBUSD (AVX512-VNNI) instead of
// tiles: a tile product costs the same for 1 row as for 16 (about 19 ns each here, two per 1 KB
// tile), so one decode row on tiles ran at 13 GB/s per core, below the memory's rate. A 64-byte
// row of a B tile is 16 channels x 4 consecutive k, so one VPDPBUSD with the row's 4 bytes at
// that k broadcast adds those 4 products into each channel's int32 lane. VPDPBUSD multiplies
// unsigned by signed bytes: the low bytes are unsigned already, the high bytes go in as h + 128
// (h xor 0x80) and 128 times the channel's weight sum (`sums`) comes off. Both sums are the
// exact integers the tiles compute, so a row gets the same bits on either path.
template <int R, int NT>
TS_VNNI void int8_vnni_pass(const uint8_t* hib, const uint8_t* lo, int64_t lda, const int8_t* b, int64_t strip,
                           int64_t KT, const int32_t* sums, int32_t* c_hi, int32_t* c_lo) {
  const int8_t* b1 = b + strip;
  __m512i ah[R][NT], al[R][NT];
  for (int r = 0; r < R; ++r) {
    for (int s = 0; s < NT; ++s) ah[r][s] = al[r][s] = _mm512_setzero_si512();
  }
  for (int64_t kt = 0; kt < KT; ++kt) {
    simd::prefetch_lines(reinterpret_cast<const char*>(b + (kt + kAheadTiles) * 2 * kTile), 2 * kTile);
    if constexpr (NT == 2) simd::prefetch_lines(reinterpret_cast<const char*>(b1 + (kt + kAheadTiles) * 2 * kTile), 2 * kTile);
    const int8_t* t0 = b + kt * 2 * kTile;
    const int8_t* t1 = b1 + kt * 2 * kTile;
    for (int64_t g = 0; g < 16; ++g) {
      const __m512i w0 = _mm512_loadu_si512(t0 + 64 * g);
      const __m512i w1 = NT == 2 ? _mm512_loadu_si512(t1 + 64 * g) : w0;
      for (int r = 0; r < R; ++r) {
        int32_t h4, l4;
        std::memcpy(&h4, hib + r * lda + kt * 64 + 4 * g, 4);
        std::memcpy(&l4, lo + r * lda + kt * 64 + 4 * g, 4);
        const __m512i xh = _mm512_set1_epi32(h4), xl = _mm512_set1_epi32(l4);
        ah[r][0] = _mm512_dpbusd_epi32(ah[r][0], xh, w0);
        al[r][0] = _mm512_dpbusd_epi32(al[r][0], xl, w0);
        if constexpr (NT == 2) {
          ah[r][NT - 1] = _mm512_dpbusd_epi32(ah[r][NT - 1], xh, w1);
          al[r][NT - 1] = _mm512_dpbusd_epi32(al[r][NT - 1], xl, w1);
        }
      }
    }
  }
  for (int s = 0; s < NT; ++s) {
    const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512(sums + 16 * s), 7);  // 128 * sum
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_si512(c_hi + r * 32 + 16 * s, _mm512_sub_epi32(ah[r][s], off));
      _mm512_storeu_si512(c_lo + r * 32 + 16 * s, al[r][s]);
    }
  }
}

template <int R>
TS_VNNI void int8_vnni(bool two, const FixedRows& xq, int64_t Kp, const int8_t* b, int64_t strip, int64_t KT,
                      const int32_t* sums, int32_t* c_hi, int32_t* c_lo) {
  if (two) int8_vnni_pass<R, 2>(xq.hi.data(), xq.lo.data(), Kp, b, strip, KT, sums, c_hi, c_lo);
  else int8_vnni_pass<R, 1>(xq.hi.data(), xq.lo.data(), Kp, b, strip, KT, sums, c_hi, c_lo);
}

// y[r, j] = fp32((256 hi + lo) * step[r] * scale[j]) for rows [0, rc) x channels [0, oc): the
// sum in double is exact (|q| < 2^53), then two products in double, rounded once to fp32.
TS_AMX void int8_out(int64_t rc, const int32_t* c_hi, const int32_t* c_lo, const float* step, const float* scale,
                     int64_t oc, float* y, int64_t N) {
  for (int64_t r = 0; r < rc; ++r) {
    const __m512d st = _mm512_set1_pd(static_cast<double>(step[r]));
    for (int64_t j = 0; j < oc; j += 8) {
      const auto m = static_cast<__mmask8>(oc - j >= 8 ? 0xFF : (1u << (oc - j)) - 1u);
      const __m512d h = _mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c_hi + r * 32 + j)));
      const __m512d l = _mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c_lo + r * 32 + j)));
      const __m512d q = _mm512_fmadd_pd(h, _mm512_set1_pd(256.0), l);  // exact
      const __m512d sc = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, scale + j));
      _mm256_mask_storeu_ps(y + r * N + j, m, _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_mul_pd(q, st), sc)));
    }
  }
}

TS_AMX void int8_block(const FixedRows& xq, int64_t rows, int64_t Kp, const int8_t* w, const float* scale,
                       const int32_t* sums, int64_t o0, int64_t o1, float* y, int64_t N) {
  const int64_t KT = Kp / 64, strip = KT * 2 * kTile;
  alignas(64) int32_t c_hi[16 * 32], c_lo[16 * 32];
  const bool vnni = xq.biased;
  Tiles tiles;
  for (int64_t o = o0; o < o1; o += 32) {
    const bool two = o + 16 < o1;
    const int8_t* b = w + (o / 16) * strip;
    for (int64_t m0 = 0; m0 < rows; m0 += 16) {
      if (vnni) {
        switch (rows) {
          case 1: int8_vnni<1>(two, xq, Kp, b, strip, KT, sums + o, c_hi, c_lo); break;
          case 2: int8_vnni<2>(two, xq, Kp, b, strip, KT, sums + o, c_hi, c_lo); break;
          case 3: int8_vnni<3>(two, xq, Kp, b, strip, KT, sums + o, c_hi, c_lo); break;
          default: int8_vnni<4>(two, xq, Kp, b, strip, KT, sums + o, c_hi, c_lo); break;
        }
      } else {
        const auto r = static_cast<uint8_t>(std::min<int64_t>(16, rows - m0));  // every tile but the weights'
        tiles.use({r, r, r, r, r, r});
        const auto* hi = reinterpret_cast<const int8_t*>(xq.hi.data()) + m0 * Kp;
        const uint8_t* lo = xq.lo.data() + m0 * Kp;
        if (two) int8_pass<2>(hi, lo, Kp, b, strip, KT, c_hi, c_lo);
        else int8_pass<1>(hi, lo, Kp, b, strip, KT, c_hi, c_lo);
      }
      // The integer sum is exact; two products in double, rounded once to fp32.
      int8_out(std::min<int64_t>(16, rows - m0), c_hi, c_lo, xq.step.data() + m0, scale + o, std::min<int64_t>(32, o1 - o),
               y + m0 * N + o, N);
    }
  }
}

}  // namespace

void amx_dot_rows(const float* x, int64_t rows, int64_t K, int64_t N, const at::Tensor& packed, const float* scale,
                  const int32_t* sums, float* y, const OutputStage& stage) {
  TS_INTERNAL_ASSERT(have_amx(), "AMX tiles need AMX-BF16 and AMX-INT8");
  const bool int8 = packed.scalar_type() == at::kChar;
  const int64_t tile_k = int8 ? 64 : 32, Kp = (K + tile_k - 1) / tile_k * tile_k;
  TS_INTERNAL_ASSERT(packed.dim() == 5 && packed.size(0) * 16 >= N && packed.size(1) * tile_k == Kp &&
                         (scale != nullptr) == int8 && (sums != nullptr) == int8,
                     "amx_dot_rows: packed ", packed.sizes(), " for [", N, ", ", K, "]");
  if (rows <= 0 || N <= 0) return;
  const int64_t blk = int8 ? 64 : std::max<int64_t>(32, channel_block(rows));  // two strips at a time
  const int64_t blocks = (N + blk - 1) / blk;
  if (int8) {
    thread_local FixedRows buffers;
    FixedRows& xq = buffers;  // the calling thread's (a lambda naming `buffers` would get its own thread's)
    xq.biased = rows <= kVnniRows && have_avx512_vnni();
    const uint8_t zero_hi = xq.biased ? 0x80 : 0;
    // Rows only: a tile configured with fewer than 16 rows reads no others.
    xq.hi.assign(static_cast<size_t>(rows * Kp), zero_hi);
    xq.lo.assign(static_cast<size_t>(rows * Kp), 0);
    xq.step.assign(static_cast<size_t>(rows), 0.0f);
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) fix_row(x + r * K, K, xq.hi.data() + r * Kp, xq.lo.data() + r * Kp, &xq.step[r], zero_hi);
    });
    const int8_t* w = packed.data_ptr<int8_t>();
    dynamic_blocks(blocks, [&](int64_t b) {
      const int64_t o0 = b * blk, o1 = std::min(N, o0 + blk);
      int8_block(xq, rows, Kp, w, scale, sums, o0, o1, y, N);
      stage.apply(y, rows, N, o0, o1);
    });
    return;
  }
  std::vector<uint16_t> xa(static_cast<size_t>(rows * Kp));
  round_rows_bf16(x, rows, K, Kp, xa.data());
  const uint16_t* w = static_cast<const uint16_t*>(packed.data_ptr());
  dynamic_blocks(blocks, [&](int64_t b) {
    const int64_t o0 = b * blk, o1 = std::min(N, o0 + blk);
    bf16_block(xa.data(), rows, Kp, w, o0, o1, y, N);
    stage.apply(y, rows, N, o0, o1);
  });
}

at::Tensor amx_channel_sums(const at::Tensor& packed) {
  TS_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kChar && packed.size(2) == 16 && packed.size(3) == 16 &&
               packed.size(4) == 4,
           "amx_channel_sums: expects int8 weights packed by amx_pack, got ", packed.scalar_type(), " ", packed.sizes());
  // [strip, k tile, k group, channel, 4] -> [strip, channel]
  return packed.to(at::kInt).sum({1, 2, 4}, false, at::kInt).reshape({-1}).contiguous();
}

bool have_avx512_vnni() {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((c >> 11) & 1u) && __builtin_cpu_supports("avx512bw");
  }();
  return yes;
}

}  // namespace torchspeed::inference
