// Shared helpers of the libFuzzer targets: the outcome rule (a torchspeed::Error other than an
// InternalError is the expected answer to bad input; any other exception is a bug and aborts,
// so libFuzzer records the input) and scratch files in memory (/dev/shm when it exists).
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <typeinfo>

#include "torchspeed/base/error.h"

namespace fuzz {

[[noreturn]] inline void bug(const char* target, const std::string& what) {
  std::fprintf(stderr, "\n==%s: BUG: %s\n", target, what.c_str());
  std::fflush(stderr);
  std::abort();
}

// FUZZ_VERBOSE=1 prints every refusal (to see why a seed or a reproducer is refused).
inline bool verbose() {
  static const bool v = std::getenv("FUZZ_VERBOSE") != nullptr;
  return v;
}

// Runs fn on input the fuzzer made up. Returns true when it completed, false when it refused
// the input with a torchspeed::Error (the expected way); aborts on anything else.
template <typename Fn>
bool run_expecting_errors(const char* target, Fn&& fn) {
  try {
    fn();
    if (verbose()) std::fprintf(stderr, "%s: accepted\n", target);
    return true;
  } catch (const torchspeed::InternalError& e) {
    bug(target, std::string("torchspeed::InternalError (a broken invariant): ") + e.what());
  } catch (const torchspeed::Error& e) {
    if (verbose()) std::fprintf(stderr, "%s: refused: %s\n", target, e.what());
    return false;
  } catch (const std::exception& e) {
    bug(target, std::string("an exception other than torchspeed::Error escaped (") +
                    typeid(e).name() + "): " + e.what());
  } catch (...) {
    bug(target, "a non-std exception escaped");
  }
}

// A private scratch folder for this process, removed at exit.
inline const std::string& scratch_dir() {
  struct Scratch {
    std::string dir;
    Scratch() {
      const char* tmp = std::getenv("TMPDIR");
      const std::string base = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : tmp ? tmp : "/tmp";
      dir = base + "/torchspeed-fuzz-" + std::to_string(::getpid());
      std::filesystem::create_directories(dir);
    }
    ~Scratch() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  };
  static const Scratch scratch;
  return scratch.dir;
}

inline void write_file(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out) bug("fuzz", "cannot write scratch file " + path);
}

}  // namespace fuzz
