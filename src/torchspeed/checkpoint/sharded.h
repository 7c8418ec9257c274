// Sharded training checkpoints: the collective protocol that writes DIR/TAG/ (one safetensors
// shard per rank that holds distinct state, manifest.json from rank 0) into a temporary folder,
// publishes it by rename only when every rank has written and fsynced, then replaces DIR/latest
// atomically and prunes old tags; and the reading side (resolve a tag, read and check the
// manifest). What goes into the shards and manifest is the engine's business (engine/).
// See Note [Checkpoint protocol] in sharded.cpp.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "torchspeed/checkpoint/io_names.h"
#include "torchspeed/comm/communicator.h"

namespace torchspeed::checkpoint {

inline constexpr const char* kManifestFormat = "torchspeed-checkpoint";
inline constexpr int kManifestVersion = 1;

struct SaveSpec {
  std::string dir, tag;
  int keep_last = 0;            // 0 keeps every tag
  nlohmann::json manifest;      // rank 0's: everything but "files" and "ranks", which save() adds
  NamedTensors tensors;         // this rank's shard; empty (and nothing streamed) writes no file
  StreamedTensors streamed;     // more of it, written in pieces (after `tensors` in the file)
  std::string file;             // this rank's shard file name inside the tag folder
  nlohmann::json rank_state;    // this rank's entry of manifest["ranks"] (RNG, client state)
  bool joined = false;          // join_save() already ran
};

// Step 1 of a save, for callers that exchange more before calling save(): every rank agrees on
// the tag; a rank that never joins ends the others' wait with a CommError naming the cause.
void join_save(comm::Communicator& comm, const std::string& dir, const std::string& tag);

// Collective over `comm` (every rank, same tag). Returns DIR/TAG. A failure on any rank throws
// the same error on every rank, naming the rank. Before DIR/TAG is renamed into place nothing is
// published: DIR/latest and the tags already in DIR are untouched. After it (DIR/latest cannot
// be written, say) the error says that DIR/TAG is complete and what DIR/latest names.
std::string save(comm::Communicator& comm, const SaveSpec& spec);

struct Opened {
  std::string path;       // DIR/TAG
  nlohmann::json manifest;
  // A shared lock on DIR/TAG/manifest.json while any copy lives: a save's keep_last pruning
  // skips a tag that is being read (Note [Readers hold their tag] in sharded.cpp). Keep the
  // Opened until the tag's files are read.
  std::shared_ptr<const void> hold;
};

// Collective: rank 0 resolves TAG ("" = the tag DIR/latest names), reads and checks
// manifest.json and shares it. nullopt when TAG is "" and DIR has no `latest`.
std::optional<Opened> open(comm::Communicator& comm, const std::string& dir, const std::string& tag);

// Not collective: the checkpoint folder PATH names (a tag folder holding manifest.json, or a
// folder with `latest`), and its manifest.
Opened open_local(const std::string& path);

// Every rank passes its error ("" for none); if any rank has one, every rank throws it (with
// `what` and the rank). Collective.
void agree(comm::Communicator& comm, const std::string& what, const std::string& local_error);

// Runs fn; its exception's message, or "" when it returned.
std::string error_of(const std::function<void()>& fn);

// Hex encoding for small binary state (RNG) inside the manifest.
std::string to_hex(const void* data, size_t n);
std::string from_hex(const std::string& hex, const std::string& what);

}  // namespace torchspeed::checkpoint
