// The checkpoint save/load protocol.
//
// Note [Checkpoint protocol]
// A save must never leave DIR in a state that loads wrongly, whatever fails and wherever:
//  1. Every rank contributes its tag to an all-gather on the caller's communicator: ranks that
//     disagree fail together, and a save called by some ranks only ends at the communicator's
//     deadline with an error instead of hanging. The engine passes a communicator of its own
//     (a save on one rank can never match another rank's training collectives) with half the
//     training deadline, so the save's error, which names the cause, comes first.
//  2. Rank 0 creates DIR if it is missing (each new folder fsynced in its parent), removes what
//     dead saves of this host left (see 5), creates DIR/.TAG.tmp-HOST-PID-NS, and shares its
//     outcome.
//  3. Each rank writes and fsyncs its shard into it, checksumming as it writes.
//  4. Outcomes, sizes, checksums and per-rank state are all-gathered. Any failure: rank 0
//     removes the temporary folder and every rank throws the same error.
//  5. Rank 0 writes manifest.json, fsyncs, renames the folder to DIR/TAG, fsyncs DIR, replaces
//     DIR/latest atomically, removes what TAG held before, prunes tags beyond keep_last (never the
//     new one, nor one being read: Note [Readers hold their tag]), and shares its outcome. An error
//     after the rename says that DIR/TAG is published and what DIR/latest names. A TAG saved before
//     (a re-save) is swapped with the temporary folder in one renameat2(RENAME_EXCHANGE), so
//     DIR/TAG is a complete checkpoint, the old or the new, at every instant; the old one then sits
//     in the temporary folder until it is removed. Where the filesystem cannot exchange, the old
//     TAG is renamed to DIR/.TAG.old-HOST-PID first; if the process dies before the new one takes
//     its name, loading reads the .old folder in its place and the next save renames it back.
// A process killed anywhere before 5's rename leaves only a temporary folder, which loading
// never looks at and a later save removes; DIR/latest still names the previous tag. Only
// temporaries of processes that no longer run on this host are removed, so jobs sharing DIR
// never delete each other's saves in progress. Loading verifies every file's size and CRC-32C
// against the manifest before any state changes.
//
// Note [Readers hold their tag]
// Pruning (keep_last) must never delete a tag while a job, or a tool such as convert, reads it.
// A reader takes a shared flock(2) on the tag's manifest.json before it reads the manifest and
// keeps it while its Opened lives (every rank of a load its own); prune takes an exclusive one
// without waiting, renames the tag out of the way while holding it (then deletes it), and
// skips a tag that is held (a warning; a later save removes it). The lock is on manifest.json
// itself: no lock file is created or left behind, and a read-only checkpoint can be read. A
// reader whose lock was granted only after prune took the tag away finds that the path no
// longer names the file it locked (stat vs fstat) and resolves `latest` again. Filesystems
// without flock(2) read and prune as before.
#include "torchspeed/checkpoint/sharded.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>  // renameat2, RENAME_EXCHANGE
#include <sys/file.h>
#include <sys/stat.h>
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
#include <memory>
#include <optional>
#include <sstream>
#include <vector>

#include "torchspeed/base/error.h"
#include "torchspeed/base/file.h"
#include "torchspeed/base/logging.h"

namespace torchspeed::checkpoint {
namespace fs = std::filesystem;
namespace {

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
// die by SIGKILL, or fail, right after writing its shard; publish:STEP kills rank 0 right after
// step STEP of publishing (manifest, aside, rename, latest, cleanup); publish-fail:rename or
// publish-fail:latest makes that step fail (renaming the tag into place, writing DIR/latest).
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
void inject_publish_fault(const char* step) {
  const char* f = std::getenv("TORCHSPEED_CHECKPOINT_FAULT");
  if (f && std::string(f) == std::string("publish:") + step) ::raise(SIGKILL);
}
void inject_publish_failure(const char* step) {
  const char* f = std::getenv("TORCHSPEED_CHECKPOINT_FAULT");
  if (f && std::string(f) == std::string("publish-fail:") + step)
    TS_CHECK(false, "injected failure of step '", step, "' (TORCHSPEED_CHECKPOINT_FAULT=", f, ")");
}

// A flock(2) on a tag's manifest.json (Note [Readers hold their tag]), released with the
// descriptor.
class ManifestLock {
 public:
  explicit ManifestLock(int fd) : fd_(fd) {}
  ~ManifestLock() { ::close(fd_); }
  ManifestLock(const ManifestLock&) = delete;
  ManifestLock& operator=(const ManifestLock&) = delete;

 private:
  int fd_;
};

int flock_retrying(int fd, int op) {
  int rc;
  while ((rc = ::flock(fd, op)) != 0 && errno == EINTR) {
  }
  return rc;
}

// A reader's shared lock on TAG_DIR/manifest.json; null when there is no manifest.json, or when
// the one locked was deleted (pruned) before the lock was granted.
std::shared_ptr<const ManifestLock> hold_tag(const fs::path& tag_dir) {
  const std::string mpath = (tag_dir / "manifest.json").string();
  const int fd = ::open(mpath.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    TS_CHECK(errno == ENOENT || errno == ENOTDIR, "cannot open '", mpath, "': ", std::strerror(errno));
    return nullptr;
  }
  auto lock = std::make_shared<const ManifestLock>(fd);
  if (flock_retrying(fd, LOCK_SH) != 0) {
    log::warn("checkpoint: cannot lock '", mpath, "' (", std::strerror(errno),
              "): reading it unlocked; a save with keep_last may delete it meanwhile");
    return lock;
  }
  struct stat held {}, named {};
  if (::fstat(fd, &held) != 0 || ::stat(mpath.c_str(), &named) != 0 || held.st_ino != named.st_ino ||
      held.st_dev != named.st_dev)
    return nullptr;
  return lock;
}

// The tag DIR/latest names, checked: it is joined into a path.
std::string tag_in_latest(const fs::path& latest) {
  const std::string t = trim(read_file(latest.string()));
  TS_CHECK(!t.empty(), latest.string(), " is empty");
  check_plain_name(t, latest.string(), "tag");
  return t;
}

// Creates DIR and the folders above it that are missing, fsyncing the folder each was created
// in: a checkpoint fsynced inside a folder whose own entry a crash can lose is not durable.
void create_folders_durably(const fs::path& dir, const std::string& what) {
  std::vector<fs::path> missing;  // DIR first
  fs::path p = dir.has_filename() ? dir : dir.parent_path();  // "a/b/" is "a/b"
  std::error_code ec;
  for (; !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
    missing.push_back(p);
    if (p == p.parent_path()) break;  // the root
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    fs::create_directory(*it, ec);  // false without an error when another process made it
    TS_CHECK(!ec && fs::is_directory(*it), "cannot create the checkpoint folder '", what, "': ",
             ec ? ec.message() : concat("'", it->string(), "' is not a folder"));
    fsync_dir(it->has_parent_path() ? it->parent_path().string() : ".");
  }
  TS_CHECK(fs::is_directory(dir), "cannot create the checkpoint folder '", what, "': not a folder");
}

std::string host_name() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "host";
  std::string h(buf);
  for (char& c : h) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_') c = '_';
  }
  return h.empty() ? "host" : h;
}

// The owner of a temporary named .TAG.tmp-HOST-PID-NS or .TAG.old-HOST-PID: whether it is
// a process of this host that no longer runs. Anything else (another host, a live process, a
// name we did not make) is left alone.
bool owner_is_dead(const std::string& name, const std::string& kind) {
  const auto at = name.rfind(kind);
  if (at == std::string::npos) return false;
  std::string rest = name.substr(at + kind.size());  // HOST-PID[-NS]
  if (kind == ".tmp-") {
    const auto dash = rest.rfind('-');
    if (dash == std::string::npos) return false;
    rest = rest.substr(0, dash);
  }
  const auto dash = rest.rfind('-');
  if (dash == std::string::npos || rest.substr(0, dash) != host_name()) return false;
  const std::string pid_s = rest.substr(dash + 1);
  if (pid_s.empty() || pid_s.find_first_not_of("0123456789") != std::string::npos) return false;
  const long pid = std::atol(pid_s.c_str());
  if (pid <= 0 || pid == ::getpid()) return false;
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

// An .old folder (a re-save that died between moving TAG aside and renaming the new one, on a
// filesystem without RENAME_EXCHANGE) of `tag` holding a complete checkpoint.
std::optional<fs::path> moved_aside(const fs::path& dir, const std::string& tag) {
  std::error_code ec;
  const std::string prefix = "." + tag + ".old-";
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) == 0 && fs::exists(e.path() / "manifest.json")) return e.path();
  }
  return std::nullopt;
}

// What dead saves of this host left: temporary folders are removed; a checkpoint moved aside by
// a re-save that died before its replacement took the name gets its name back.
void remove_stale_temporaries(const fs::path& dir) {
  std::error_code ec;
  std::vector<fs::path> stale;
  for (const auto& e : fs::directory_iterator(dir, ec)) stale.push_back(e.path());
  for (const auto& p : stale) {
    const std::string n = p.filename().string();
    if (n.size() < 2 || n[0] != '.') continue;
    if (n.find(".tmp-") != std::string::npos && owner_is_dead(n, ".tmp-")) {
      fs::remove_all(p, ec);
    } else if (n.find(".old-") != std::string::npos && owner_is_dead(n, ".old-")) {
      const std::string tag = n.substr(1, n.rfind(".old-") - 1);
      if (!fs::exists(dir / tag) && fs::exists(p / "manifest.json")) {
        fs::rename(p, dir / tag, ec);
        if (ec) log::warn("checkpoint: cannot restore '", p.string(), "' as '", (dir / tag).string(), "': ", ec.message());
      } else {
        fs::remove_all(p, ec);
      }
    }
  }
}

// rename(from, to) that swaps two existing folders atomically; false where the filesystem
// cannot (EINVAL, ENOSYS, ENOTSUP), or when TORCHSPEED_CHECKPOINT_NO_EXCHANGE is set (tests of
// the other path).
bool swap_folders(const std::string& from, const std::string& to) {
  if (std::getenv("TORCHSPEED_CHECKPOINT_NO_EXCHANGE")) return false;
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) return true;
  const int e = errno;
  TS_CHECK(e == EINVAL || e == ENOSYS || e == ENOTSUP, "cannot exchange '", from, "' and '", to, "': ", std::strerror(e));
  return false;
}

// Keeps the newest `keep_last` complete tags (by the manifest's saved_at_ns) and `keep`.
void prune(const fs::path& dir, int keep_last, const std::string& keep) {
  std::vector<std::pair<int64_t, fs::path>> tags;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (!e.is_directory() || n.empty() || n[0] == '.' || n == keep) continue;
    try {
      const auto m = nlohmann::json::parse(read_file((e.path() / "manifest.json").string()));
      if (m.value("format", "") == kManifestFormat) tags.emplace_back(m.value("saved_at_ns", int64_t{0}), e.path());
    } catch (const std::exception&) {
      // Not one of our checkpoints: never delete it.
    }
  }
  std::sort(tags.begin(), tags.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t i = static_cast<size_t>(std::max(keep_last - 1, 0)); i < tags.size(); ++i) {
    const fs::path& tag = tags[i].second;
    const std::string mpath = (tag / "manifest.json").string();
    // The tag is renamed out of the way under the lock: new readers no longer find it, and one
    // whose lock was waiting finds it gone. It is deleted after the lock is released: over NFS a
    // file deleted while open leaves a .nfs file behind that keeps its folder from going. A
    // process that dies in between leaves a temporary that a later save removes.
    const std::string doomed = (dir / concat(".", tag.filename().string(), ".tmp-", host_name(), "-", ::getpid(), "-",
                                             std::chrono::system_clock::now().time_since_epoch().count())).string();
    {
      // Read-write where we may: over NFS flock(2) is a POSIX lock, and an exclusive one needs a
      // descriptor open for writing. Nothing is written.
      int fd = ::open(mpath.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) fd = ::open(mpath.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;  // gone meanwhile
      const ManifestLock lock(fd);
      if (flock_retrying(fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno == EWOULDBLOCK) {
          log::warn("checkpoint.keep_last: '", tag.string(), "' is being read: kept for now, a later save removes it");
          continue;
        }
        log::warn("checkpoint.keep_last: cannot lock '", mpath, "' (", std::strerror(errno), "): removing it unlocked");
      }
      fs::rename(tag, doomed, ec);
      if (ec) {
        log::warn("checkpoint.keep_last: cannot remove '", tag.string(), "': ", ec.message());
        continue;
      }
    }
    fs::remove_all(doomed, ec);
    if (ec) log::warn("checkpoint.keep_last: cannot remove '", doomed, "': ", ec.message());
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
      create_folders_durably(dir, spec.dir);
      remove_stale_temporaries(dir);
      const auto ns = std::chrono::system_clock::now().time_since_epoch().count();
      tmp = (dir / concat(".", spec.tag, ".tmp-", host_name(), "-", ::getpid(), "-", ns)).string();
      TS_CHECK(!fs::exists(final_path) || fs::exists(final_path / "manifest.json"), "'", final_path.string(),
               "' exists and is not a torchspeed checkpoint (no manifest.json): a save will not replace it");
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
    if (!spec.tensors.empty() || !spec.streamed.tensors.empty()) {
      check_plain_name(spec.file, what, "shard file");
      const FileDigest d = save_safetensors_streamed(tmp + "/" + spec.file, spec.tensors, spec.streamed,
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
    std::string old;  // what TAG held before, once the new checkpoint has the name
    // How far publishing got, so that an error says what is published and what `latest` names.
    enum { kNothing, kRenamed, kLatest } published = kNothing;
    const fs::path latest = dir / "latest";
    std::optional<std::string> before;  // what `latest` named; nullopt: none (an unreadable one too)
    error_of([&] {
      if (fs::exists(latest)) before = trim(read_file(latest.string()));
    });
    err = error_of([&] {
      nlohmann::json m = spec.manifest;
      m["format"] = kManifestFormat;
      m["format_version"] = kManifestVersion;
      m["tag"] = spec.tag;
      m["saved_at_ns"] = std::chrono::system_clock::now().time_since_epoch().count();
      m["files"] = files;
      m["ranks"] = ranks;
      write_file_atomic(tmp + "/manifest.json", m.dump(1) + "\n");  // fsyncs the file and the folder
      inject_publish_fault("manifest");
      std::error_code ec;
      inject_publish_failure("rename");
      if (fs::exists(final_path) && swap_folders(tmp, final_path.string())) {
        old = tmp;
      } else {
        if (fs::exists(final_path)) {
          old = (dir / concat(".", spec.tag, ".old-", host_name(), "-", ::getpid())).string();
          fs::rename(final_path, old, ec);
          TS_CHECK(!ec, "cannot move the previous '", final_path.string(), "' aside: ", ec.message());
          inject_publish_fault("aside");
        }
        fs::rename(tmp, final_path, ec);
        TS_CHECK(!ec, "cannot rename '", tmp, "' to '", final_path.string(), "': ", ec.message());
      }
      published = kRenamed;
      fsync_dir(spec.dir);
      inject_publish_fault("rename");
      inject_publish_failure("latest");
      write_file_atomic(latest.string(), spec.tag + "\n");
      published = kLatest;
      inject_publish_fault("latest");
      if (!old.empty()) fs::remove_all(old, ec);
      inject_publish_fault("cleanup");
      if (spec.keep_last > 0) prune(dir, spec.keep_last, spec.tag);
    });
    if (!err.empty()) {
      // tmp never holds the only complete copy: after an exchange TAG holds the new one. A
      // checkpoint moved aside gets its name back if the new one did not take it.
      std::error_code ec;
      fs::remove_all(tmp, ec);
      if (!old.empty() && old != tmp && !fs::exists(final_path)) fs::rename(old, final_path, ec);
      const std::string tag_path = final_path.string(), latest_path = latest.string();
      if (published == kNothing) {
        err += concat(". Nothing was published: ", latest_path, " and the checkpoints already there are untouched");
      } else if (published == kRenamed) {
        err += concat(". The checkpoint is complete and published at ", tag_path, ", but ", latest_path,
                      !before                ? " was not written: there is no latest tag (load this one by its tag)"
                      : *before == spec.tag ? concat(" names '", spec.tag, "' already")
                                             : concat(" still names the previous tag '", *before, "'"));
      } else {
        err += concat(". The checkpoint is published at ", tag_path, " and ", latest_path, " names it");
      }
    }
  }
  agree(comm, what, err);
  return final_path.string();
}

namespace {
// The checkpoint PATH names (with via_latest, the tag PATH/latest names), its manifest read and
// checked under the reader's lock (Note [Readers hold their tag]).
Opened open_held(const std::string& path, bool via_latest) {
  fs::path p;
  std::shared_ptr<const ManifestLock> hold;
  for (int attempt = 0;; ++attempt) {
    p = path;
    if (via_latest) p /= tag_in_latest(p / "latest");
    if (!fs::exists(p) && p.has_parent_path()) {
      // A re-save that died with the old checkpoint moved aside (Note [Checkpoint protocol]).
      if (auto aside = moved_aside(p.parent_path(), p.filename().string())) p = *aside;
    }
    hold = hold_tag(p);
    // A tag pruned while we resolved it: `latest` names a newer one by then.
    if (hold || !via_latest || attempt == 2) break;
  }
  const std::string mpath = (p / "manifest.json").string();
  TS_CHECK(hold, "'", path, "' is not a torchspeed checkpoint: no manifest.json",
           fs::exists(p) ? "" : " (the folder does not exist)");
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(read_file(mpath));
  } catch (const nlohmann::json::parse_error& e) {
    TS_CHECK(false, mpath, ": corrupt manifest at byte ", e.byte, ": ", e.what());
  } catch (const nlohmann::json::exception& e) {
    // A number beyond double's range (out_of_range.406) is not a parse_error.
    TS_CHECK(false, mpath, ": corrupt manifest: ", e.what());
  }
  // Types are checked before value() reads them: value() throws json's type_error on a mismatch.
  const auto format = m.is_object() ? m.find("format") : m.end();
  TS_CHECK(
      format != m.end() && format->is_string() && format->get<std::string>() == kManifestFormat,
      mpath, ": not a torchspeed checkpoint manifest");
  int64_t version = 0;
  if (const auto it = m.find("format_version"); it != m.end()) {
    TS_CHECK(it->is_number_integer(), mpath, ": format_version must be an integer, found ",
             it->dump());
    version = it->is_number_unsigned() && it->get<uint64_t>() > uint64_t{INT64_MAX}
                  ? INT64_MAX
                  : it->get<int64_t>();
  }
  TS_CHECK(version <= kManifestVersion, mpath, ": format version ", version,
           " is newer than this torchspeed reads (", kManifestVersion, ")");
  for (const char* key : {"files", "ranks", "params", "zero", "engine", "grid"})
    TS_CHECK(m.contains(key), mpath, ": the manifest has no \"", key, "\"");
  TS_CHECK(m["files"].is_object(), mpath, ": \"files\" must be an object, found ", m["files"].dump());
  for (const auto& [name, f] : m["files"].items()) check_plain_name(name, mpath, "shard file");
  return {p.string(), std::move(m), std::move(hold)};
}
}  // namespace

Opened open_local(const std::string& path) {
  const fs::path p(path);
  return open_held(path, !fs::exists(p / "manifest.json") && fs::exists(p / "latest"));
}

std::optional<Opened> open(comm::Communicator& comm, const std::string& dir, const std::string& tag) {
  std::string status, err;
  Opened opened;  // holds the tag (Note [Readers hold their tag])
  if (comm.rank() == 0) {
    nlohmann::json s;
    err = error_of([&] {
      if (tag.empty()) {
        const fs::path latest = fs::path(dir) / "latest";
        if (!fs::exists(latest)) {
          s["none"] = true;
          return;
        }
        opened = open_held(dir, /*via_latest=*/true);
      } else {
        check_tag(tag);
        const fs::path p = fs::path(dir) / tag;
        TS_CHECK(fs::exists(p / "manifest.json"), "no checkpoint '", tag, "' in '", dir, "'",
                 fs::exists(p) ? " (the folder has no manifest.json: an incomplete save?)" : "");
        opened = open_held(p.string(), /*via_latest=*/false);
      }
      s["path"] = opened.path;
      s["manifest"] = opened.manifest;
    });
    if (!err.empty()) s = {{"error", err}};
    status = s.dump();
  }
  const auto all = comm::all_gather_strings(comm, status);
  const auto s = nlohmann::json::parse(all[0]);
  TS_CHECK(!s.contains("error"), "load_checkpoint('", dir, "'", tag.empty() ? "" : ", tag '" + tag + "'", "): ",
           s.value("error", ""));
  if (s.contains("none")) return std::nullopt;
  // Every rank holds the tag while it reads: rank 0 holds it until all have taken their lock.
  if (comm.rank() != 0) {
    opened = {s["path"].get<std::string>(), s["manifest"], nullptr};
    err = error_of([&] {
      opened.hold = hold_tag(opened.path);
      TS_CHECK(opened.hold, "'", opened.path, "/manifest.json' does not exist on this rank");
    });
  }
  agree(comm, concat("load_checkpoint('", opened.path, "')"), err);
  return opened;
}

}  // namespace torchspeed::checkpoint
