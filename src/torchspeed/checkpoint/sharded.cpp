// The checkpoint save/load protocol.
//
// Note [Checkpoint protocol]
// A save must never leave DIR in a state that loads wrongly, whatever fails and wherever:
//  1. Every rank contributes its tag to an all-gather on the caller's communicator: ranks that
//     disagree fail together, and a save called by some ranks only ends at the communicator's
//     deadline with an error instead of hanging. The engine passes a communicator of its own
//     (a save on one rank can never match another rank's training collectives) with half the
//     training deadline, so the save's error, which names the cause, comes first.
//  2. Rank 0 creates DIR/.TAG.tmp-PID-NS and shares its outcome.
//  3. Each rank writes and fsyncs its shard into it, checksumming as it writes.
//  4. Outcomes, sizes, checksums and per-rank state are all-gathered. Any failure: rank 0
//     removes the temporary folder and every rank throws the same error.
//  5. Rank 0 writes manifest.json, fsyncs, renames the folder to DIR/TAG (an existing TAG is
//     moved aside first and removed after), fsyncs DIR, replaces DIR/latest atomically, prunes
//     tags beyond keep_last (never the new one), and shares its outcome.
// A process killed anywhere before 5's rename leaves only a temporary folder, which loading
// never looks at and the next save removes; DIR/latest still names the previous tag. Loading
// verifies every file's size and CRC-32C against the manifest before any state changes.
#include "torchspeed/checkpoint/sharded.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "torchspeed/runtime/error.h"
#include "torchspeed/runtime/logging.h"

namespace torchspeed::checkpoint {
namespace fs = std::filesystem;
namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TS_CHECK(in.good(), "cannot read '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

void check_tag(const std::string& tag) {
  TS_CHECK(!tag.empty() && tag[0] != '.' && tag.find('/') == std::string::npos && tag != "latest",
           "checkpoint tag '", tag, "': a tag must be a non-empty folder name that does not start with '.', ",
           "contain '/' or equal 'latest'");
}

// Test hook (fault-injection tests): TORCHSPEED_CHECKPOINT_FAULT=kill:R or fail:R makes rank R
// die by SIGKILL, or fail, right after writing its shard.
void inject_fault(int rank) {
  const char* f = std::getenv("TORCHSPEED_CHECKPOINT_FAULT");
  if (!f) return;
  const std::string spec(f);
  const auto colon = spec.find(':');
  if (colon == std::string::npos || std::atoi(spec.c_str() + colon + 1) != rank) return;
  const std::string kind = spec.substr(0, colon);
  if (kind == "kill") ::raise(SIGKILL);
  if (kind == "fail") TS_CHECK(false, "injected failure (TORCHSPEED_CHECKPOINT_FAULT=", spec, ")");
}

// Folders left by interrupted saves of any tag.
void remove_stale_temporaries(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() > 1 && n[0] == '.' && (n.find(".tmp-") != std::string::npos || n.find(".old-") != std::string::npos)) {
      fs::remove_all(e.path(), ec);
    }
  }
}

// Keeps the newest `keep_last` complete tags (by the manifest's saved_at_ns) and `keep`.
void prune(const fs::path& dir, int keep_last, const std::string& keep) {
  std::vector<std::pair<int64_t, fs::path>> tags;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (!e.is_directory() || n.empty() || n[0] == '.' || n == keep) continue;
    try {
      const auto m = nlohmann::json::parse(read_text((e.path() / "manifest.json").string()));
      if (m.value("format", "") == kManifestFormat) tags.emplace_back(m.value("saved_at_ns", int64_t{0}), e.path());
    } catch (const std::exception&) {
      // Not one of our checkpoints: never delete it.
    }
  }
  std::sort(tags.begin(), tags.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t i = static_cast<size_t>(std::max(keep_last - 1, 0)); i < tags.size(); ++i) {
    fs::remove_all(tags[i].second, ec);
    if (ec) log::warn("checkpoint.keep_last: cannot remove '", tags[i].second.string(), "': ", ec.message());
  }
}

}  // namespace

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
    return "";
  } catch (const std::exception& e) {
    return e.what()[0] ? e.what() : "unknown error";
  }
}

std::string to_hex(const void* data, size_t n) {
  static const char* digits = "0123456789abcdef";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = digits[p[i] >> 4];
    s[2 * i + 1] = digits[p[i] & 15];
  }
  return s;
}

std::string from_hex(const std::string& hex, const std::string& what) {
  TS_CHECK(hex.size() % 2 == 0, what, ": odd-length hex string");
  auto val = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    TS_CHECK(false, what, ": invalid hex digit '", c, "'");
  };
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(val(hex[2 * i]) * 16 + val(hex[2 * i + 1]));
  return out;
}

void agree(comm::Communicator& comm, const std::string& what, const std::string& local_error) {
  const auto errors = comm::all_gather_strings(comm, local_error);
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r].empty()) TS_CHECK(false, what, " failed on rank ", r, ": ", errors[r]);
  }
}

void join_save(comm::Communicator& comm, const std::string& dir, const std::string& tag) {
  const std::string what = concat("save_checkpoint('", dir, "', tag '", tag, "')");
  std::string err = error_of([&] { check_tag(tag); });
  // 1. Same tag everywhere; this is also where a rank that never calls save is noticed.
  std::vector<std::string> tags;
  try {
    tags = comm::all_gather_strings(comm, tag);
  } catch (const CommError& e) {
    throw CommError(concat(what, ": not every rank joined the save (save_checkpoint is collective: call it on ",
                           "every rank, at the same step, with the same tag): ", e.what()));
  }
  for (size_t r = 0; r < tags.size(); ++r)
    if (err.empty() && tags[r] != tag) err = concat("rank ", r, " saves tag '", tags[r], "'");
  agree(comm, what, err);
}

std::string save(comm::Communicator& comm, const SaveSpec& spec) {
  const bool root = comm.rank() == 0;
  const std::string what = concat("save_checkpoint('", spec.dir, "', tag '", spec.tag, "')");
  if (!spec.joined) join_save(comm, spec.dir, spec.tag);
  std::string err;

  // 2. The temporary folder.
  const fs::path dir(spec.dir), final_path = dir / spec.tag;
  std::string tmp;
  if (root) {
    err = error_of([&] {
      std::error_code ec;
      fs::create_directories(dir, ec);
      TS_CHECK(!ec && fs::is_directory(dir), "cannot create the checkpoint folder '", spec.dir, "': ",
               ec ? ec.message() : "not a folder");
      remove_stale_temporaries(dir);
      const auto ns = std::chrono::system_clock::now().time_since_epoch().count();
      tmp = (dir / concat(".", spec.tag, ".tmp-", ::getpid(), "-", ns)).string();
      fs::create_directory(tmp, ec);
      TS_CHECK(!ec, "cannot create '", tmp, "': ", ec.message());
    });
  }
  const auto shared = comm::all_gather_strings(comm, root ? (err.empty() ? "ok:" + tmp : "error:" + err) : "");
  if (shared[0].rfind("error:", 0) == 0) TS_CHECK(false, what, " failed on rank 0: ", shared[0].substr(6));
  tmp = shared[0].substr(3);

  // 3. This rank's shard.
  nlohmann::json mine = {{"rank_state", spec.rank_state}};
  err = error_of([&] {
    if (!spec.tensors.empty()) {
      const FileDigest d = save_safetensors(tmp + "/" + spec.file, spec.tensors,
                                            {{"format", "pt"}, {"producer", "torchspeed"}, {"rank", std::to_string(comm.rank())}},
                                            /*atomic=*/false);
      mine["file"] = {{"name", spec.file}, {"bytes", d.bytes}, {"crc32c", d.crc32c}, {"rank", comm.rank()}};
    }
    inject_fault(comm.rank());
  });
  mine["error"] = err;

  // 4. Everyone's outcome.
  const auto outcomes = comm::all_gather_strings(comm, mine.dump());
  std::string first_error;
  nlohmann::json files = nlohmann::json::object(), ranks = nlohmann::json::array();
  for (size_t r = 0; r < outcomes.size(); ++r) {
    const auto o = nlohmann::json::parse(outcomes[r]);
    const std::string e = o.value("error", "");
    if (!e.empty() && first_error.empty()) first_error = concat("rank ", r, ": ", e);
    if (o.contains("file")) files[o["file"]["name"].get<std::string>()] = o["file"];
    ranks.push_back(o["rank_state"]);
  }
  if (!first_error.empty()) {
    if (root) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
    TS_CHECK(false, what, " failed on ", first_error, ". Nothing was published: ", spec.dir,
             "/latest and the checkpoints already there are untouched");
  }

  // 5. Publish.
  if (root) {
    err = error_of([&] {
      nlohmann::json m = spec.manifest;
      m["format"] = kManifestFormat;
      m["format_version"] = kManifestVersion;
      m["tag"] = spec.tag;
      m["saved_at_ns"] = std::chrono::system_clock::now().time_since_epoch().count();
      m["files"] = files;
      m["ranks"] = ranks;
      write_file_atomic(tmp + "/manifest.json", m.dump(1) + "\n");  // fsyncs the file and the folder
      std::error_code ec;
      std::string aside;
      if (fs::exists(final_path)) {
        aside = (dir / concat(".", spec.tag, ".old-", ::getpid())).string();
        fs::rename(final_path, aside, ec);
        TS_CHECK(!ec, "cannot move the previous '", final_path.string(), "' aside: ", ec.message());
      }
      fs::rename(tmp, final_path, ec);
      TS_CHECK(!ec, "cannot rename '", tmp, "' to '", final_path.string(), "': ", ec.message());
      fsync_dir(spec.dir);
      write_file_atomic((dir / "latest").string(), spec.tag + "\n");
      if (!aside.empty()) fs::remove_all(aside, ec);
      if (spec.keep_last > 0) prune(dir, spec.keep_last, spec.tag);
    });
    if (!err.empty()) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
  }
  agree(comm, what, err);
  return final_path.string();
}

Opened open_local(const std::string& path) {
  fs::path p(path);
  if (!fs::exists(p / "manifest.json") && fs::exists(p / "latest")) p /= trim(read_text((p / "latest").string()));
  const std::string mpath = (p / "manifest.json").string();
  TS_CHECK(fs::exists(mpath), "'", path, "' is not a torchspeed checkpoint: no manifest.json",
           fs::exists(p) ? "" : " (the folder does not exist)");
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(read_text(mpath));
  } catch (const nlohmann::json::parse_error& e) {
    TS_CHECK(false, mpath, ": corrupt manifest at byte ", e.byte, ": ", e.what());
  }
  TS_CHECK(m.is_object() && m.value("format", "") == kManifestFormat, mpath, ": not a torchspeed checkpoint manifest");
  TS_CHECK(m.value("format_version", 0) <= kManifestVersion, mpath, ": format version ", m.value("format_version", 0),
           " is newer than this torchspeed reads (", kManifestVersion, ")");
  for (const char* key : {"files", "ranks", "params", "zero", "engine", "grid"})
    TS_CHECK(m.contains(key), mpath, ": the manifest has no \"", key, "\"");
  return {p.string(), std::move(m)};
}

std::optional<Opened> open(comm::Communicator& comm, const std::string& dir, const std::string& tag) {
  std::string status;
  if (comm.rank() == 0) {
    nlohmann::json s;
    const std::string err = error_of([&] {
      if (tag.empty()) {
        const fs::path latest = fs::path(dir) / "latest";
        if (!fs::exists(latest)) {
          s["none"] = true;
          return;
        }
        const std::string t = trim(read_text(latest.string()));
        TS_CHECK(!t.empty(), latest.string(), " is empty");
        auto o = open_local((fs::path(dir) / t).string());
        s["path"] = o.path;
        s["manifest"] = std::move(o.manifest);
      } else {
        check_tag(tag);
        const fs::path p = fs::path(dir) / tag;
        TS_CHECK(fs::exists(p / "manifest.json"), "no checkpoint '", tag, "' in '", dir, "'",
                 fs::exists(p) ? " (the folder has no manifest.json: an incomplete save?)" : "");
        auto o = open_local(p.string());
        s["path"] = o.path;
        s["manifest"] = std::move(o.manifest);
      }
    });
    if (!err.empty()) s = {{"error", err}};
    status = s.dump();
  }
  const auto all = comm::all_gather_strings(comm, status);
  const auto s = nlohmann::json::parse(all[0]);
  TS_CHECK(!s.contains("error"), "load_checkpoint('", dir, "'", tag.empty() ? "" : ", tag '" + tag + "'", "): ",
           s.value("error", ""));
  if (s.contains("none")) return std::nullopt;
  return Opened{s["path"].get<std::string>(), s["manifest"]};
}

}  // namespace torchspeed::checkpoint
