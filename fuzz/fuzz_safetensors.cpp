// libFuzzer target: the safetensors reader (header length, JSON header, dtype/shape/offset
// checks, tensor data). The bytes are a file; it is read without and with the digest a
// manifest would give. A file that loads must load identically with its own size and CRC-32C,
// be refused with a wrong CRC-32C, and survive a save/load round trip bit for bit.
// Refusals are torchspeed::Error; anything else is a bug (see fuzz_util.h).
#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "fuzz_util.h"
#include "torchspeed/checkpoint/io_names.h"

namespace {

namespace ck = torchspeed::checkpoint;
constexpr const char* kTarget = "fuzz_safetensors";

bool same(const ck::SafetensorsFile& a, const ck::SafetensorsFile& b) {
  if (a.tensors.size() != b.tensors.size() || a.metadata != b.metadata) return false;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& [na, ta] = a.tensors[i];
    const auto& [nb, tb] = b.tensors[i];
    if (na != nb || ta.scalar_type() != tb.scalar_type() || ta.sizes() != tb.sizes()) return false;
    const size_t bytes = static_cast<size_t>(ta.numel()) * ta.element_size();
    if (bytes && std::memcmp(ta.data_ptr(), tb.data_ptr(), bytes) != 0) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string in = fuzz::scratch_dir() + "/in.safetensors";
  static const std::string out = fuzz::scratch_dir() + "/out.safetensors";
  fuzz::write_file(in, data, size);

  ck::SafetensorsFile plain, checked;
  const bool ok = fuzz::run_expecting_errors(kTarget, [&] { plain = ck::load_safetensors(in); });
  const ck::FileDigest digest{static_cast<int64_t>(size), ck::crc32c(0, data, size)};
  const bool ok_checked =
      fuzz::run_expecting_errors(kTarget, [&] { checked = ck::load_safetensors(in, &digest); });
  if (ok != ok_checked)
    fuzz::bug(kTarget, ok ? "refused with its own digest" : "accepted only with a digest");
  if (!ok) return 0;
  if (plain.digest.bytes != digest.bytes || plain.digest.crc32c != digest.crc32c)
    fuzz::bug(kTarget, "the digest returned differs from the file's size and CRC-32C");
  if (!same(plain, checked)) fuzz::bug(kTarget, "loading with a digest returns other tensors");
  const ck::FileDigest wrong{digest.bytes, digest.crc32c ^ 1u};
  if (fuzz::run_expecting_errors(kTarget, [&] { (void)ck::load_safetensors(in, &wrong); }))
    fuzz::bug(kTarget, "accepted with a wrong CRC-32C");

  ck::SafetensorsFile again;
  fuzz::run_expecting_errors(kTarget, [&] {
    const ck::FileDigest written =
        ck::save_safetensors(out, plain.tensors, plain.metadata, /*atomic=*/false);
    again = ck::load_safetensors(out, &written);
  });
  if (!same(plain, again))
    fuzz::bug(kTarget, "a loaded file does not survive save and load unchanged");
  return 0;
}
