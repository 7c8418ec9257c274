// The BPE tokenizer's files: GPT-2's vocab.json + merges.txt, Hugging Face's tokenizer.json and
// GGUF's tokenizer metadata in; tokenizer.json and GGUF metadata out.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <tuple>
#include <unordered_set>

#include "torchspeed/io/gguf.h"
#include "torchspeed/data/bpe_internal.h"
#include "torchspeed/base/error.h"
#include "torchspeed/base/file.h"

namespace torchspeed::data {

using namespace bpe;

namespace {
// A JSON integer token id as int64. nlohmann would wrap an unsigned one past INT64_MAX to a
// negative number, so it is refused here as the file wrote it.
int64_t json_id(const nlohmann::json& v, const std::string& what) {
  TS_CHECK(!v.is_number_unsigned() || v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX), what, " has id ", v.dump(),
           ", past any vocabulary");
  return v.get<int64_t>();
}
}  // namespace

nlohmann::json BpeTokenizer::to_tokenizer_json() const {
  using json = nlohmann::json;
  auto byte_level = [](bool regex) {
    return json{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", regex}};
  };
  json steps = json::array();
  bool byte_level_last = false;
  if (pre_.empty()) {
    steps.push_back(byte_level(true));
    byte_level_last = true;
  }
  for (const auto& st : pre_) {
    byte_level_last = st->kind == PreStep::Kind::kGpt2;
    if (st->kind == PreStep::Kind::kGpt2) steps.push_back(byte_level(true));
    if (st->kind == PreStep::Kind::kDigits) steps.push_back({{"type", "Digits"}, {"individual_digits", true}});
    if (st->kind == PreStep::Kind::kRegex) {
      steps.push_back({{"type", "Split"}, {"pattern", {{"Regex", st->pattern}}}, {"behavior", st->removed ? "Removed" : "Isolated"},
                       {"invert", false}});
    }
  }
  if (!byte_level_last) steps.push_back(byte_level(false));  // the byte mapping, no further split
  json merges = json::array();
  for (const auto& [a, b] : merge_order_) {
    merges.push_back(id_to_token_[static_cast<size_t>(a)] + " " + id_to_token_[static_cast<size_t>(b)]);
  }
  json vocab = json::object();
  for (size_t id = 0; id < id_to_token_.size(); ++id) {
    const std::string& tok = id_to_token_[id];
    if (tok.empty()) continue;
    // A GGUF string listed twice encodes as its first id (take_gguf_specials): the later ids
    // stay out of a vocabulary object, which holds one id per string.
    if (const auto it = vocab_.find(tok); it != vocab_.end() && it->second != static_cast<int64_t>(id)) continue;
    vocab[tok] = static_cast<int64_t>(id);
  }
  json added = json::array();
  std::vector<std::pair<std::string, int64_t>> specials(added_.begin(), added_.end());
  std::sort(specials.begin(), specials.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  for (const auto& [content, id] : specials) {
    added.push_back({{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                     {"normalized", false}, {"special", true}});
  }
  const std::string& meta = kMeta;
  json normalizer = nfc_ ? json{{"type", "NFC"}} : json(nullptr);
  json pre_tokenizer = steps.size() == 1 ? steps[0] : json{{"type", "Sequence"}, {"pretokenizers", steps}};
  json decoder = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  if (spm_) {  // Note [SentencePiece-style BPE]
    json norms = json::array();
    if (nfc_) norms.push_back({{"type", "NFC"}});
    if (prepend_) norms.push_back({{"type", "Prepend"}, {"prepend", meta}});
    if (replace_space_) norms.push_back({{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", meta}});
    normalizer = norms.empty() ? json(nullptr) : norms.size() == 1 ? norms[0] : json{{"type", "Sequence"}, {"normalizers", norms}};
    pre_tokenizer = nullptr;
    if (metaspace_ != Metaspace::kNone) {
      pre_tokenizer = {{"type", "Metaspace"}, {"replacement", meta},
                       {"prepend_scheme", metaspace_ == Metaspace::kAlways ? "always" : metaspace_ == Metaspace::kFirst ? "first" : "never"},
                       {"split", metaspace_split_}};
    }
    json decs = json::array({{{"type", "Replace"}, {"pattern", {{"String", meta}}}, {"content", " "}}});
    if (byte_fallback_) decs.push_back({{"type", "ByteFallback"}});
    decs.push_back({{"type", "Fuse"}});
    if (prepend_ || metaspace_ == Metaspace::kAlways || metaspace_ == Metaspace::kFirst)
      decs.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
    decoder = {{"type", "Sequence"}, {"decoders", decs}};
  }
  json post_processor = nullptr;
  if (add_bos_ >= 0) {
    const std::string bos = id_to_token_[static_cast<size_t>(add_bos_)];
    post_processor = {{"type", "TemplateProcessing"},
                      {"single", json::array({{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                      {"pair", json::array({{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                            {{"SpecialToken", {{"id", bos}, {"type_id", 1}}}}, {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
                      {"special_tokens", {{bos, {{"id", bos}, {"ids", json::array({add_bos_})}, {"tokens", json::array({bos})}}}}}};
  }
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", normalizer},
          {"pre_tokenizer", pre_tokenizer},
          {"post_processor", post_processor},
          {"decoder", decoder},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", unk_ >= 0 ? json(id_to_token_[static_cast<size_t>(unk_)]) : json(nullptr)},
            {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr}, {"fuse_unk", fuse_unk_},
            {"byte_fallback", byte_fallback_}, {"ignore_merges", ignore_merges_}, {"vocab", vocab}, {"merges", merges}}}};
}

BpeTokenizer::GgufVocab BpeTokenizer::gguf_vocab(int64_t n_vocab) const {
  GgufVocab v;
  TS_CHECK(n_vocab >= vocab_size(), source_, ": the model's vocabulary (", n_vocab, ") is smaller than the tokenizer's (",
           vocab_size(), ")");
  v.model = spm_ ? "llama" : "gpt2";
  if (!spm_) {
    auto pattern_is = [&](const char* p) { return pre_.size() == 1 && pre_[0]->kind == PreStep::Kind::kRegex && pre_[0]->pattern == p; };
    if (pre_.empty()) {
      v.pre = "gpt-2";
    } else if (pre_.size() == 2 && pre_[0]->kind == PreStep::Kind::kDigits && pre_[1]->kind == PreStep::Kind::kGpt2) {
      v.pre = "smollm";
    } else if (pattern_is(kLlama3Pattern) && ignore_merges_) {
      v.pre = "llama-bpe";
    } else if (pattern_is(kQwen2Pattern) && nfc_) {
      v.pre = "qwen2";
    } else {
      TS_CHECK(false, source_, ": this pre-tokenizer has no llama.cpp name (GPT-2's pattern, SmolLM's digits, Llama 3's and ",
               "Qwen2's regexes do): a GGUF file could not say how to split text");
    }
    for (const auto& [a, b] : merge_order_) {
      v.merges.push_back(id_to_token_[static_cast<size_t>(a)] + " " + id_to_token_[static_cast<size_t>(b)]);
    }
  } else {
    TS_CHECK(!nfc_, source_, ": an NFC normalizer has no place in a GGUF SentencePiece vocabulary");
    TS_CHECK(metaspace_ != Metaspace::kNever, source_, ": Metaspace prepend_scheme never has no GGUF form");
    // Mistral's Metaspace (prepend "first") and Llama 2's Prepend differ only after added tokens.
    v.add_space_prefix = prepend_ || metaspace_ != Metaspace::kNone;
  }
  std::vector<bool> special(static_cast<size_t>(n_vocab), false);
  for (const auto& a : added_) {
    // Every reader keeps added ids inside the id table, which n_vocab covers.
    TS_INTERNAL_ASSERT(a.second >= 0 && a.second < n_vocab, source_, ": added token id ", a.second, " outside ", n_vocab);
    special[static_cast<size_t>(a.second)] = true;
  }
  // SentencePiece scores: a token made by merge rank r scores -r (earlier merges first); tokens no
  // merge makes score below every merge.
  std::vector<float> score;
  if (spm_) {
    score.assign(static_cast<size_t>(n_vocab), -1e9f);
    for (const auto& [key, rm] : merges_) {
      float& s = score[static_cast<size_t>(rm.second)];
      s = std::max(s, -static_cast<float>(rm.first));
    }
  }
  for (int64_t id = 0; id < n_vocab; ++id) {
    const bool have = id < vocab_size() && !id_to_token_[static_cast<size_t>(id)].empty();
    v.tokens.push_back(have ? id_to_token_[static_cast<size_t>(id)] : concat("[PAD", id, "]"));
    int32_t type = have ? 1 : 5;
    if (have && special[static_cast<size_t>(id)]) type = 3;
    if (have && id == unk_) type = 2;
    if (have && spm_ && byte_fallback_ && byte_of_token_.count(id)) type = 6;
    v.types.push_back(type);
    if (spm_) v.scores.push_back(type == 1 ? score[static_cast<size_t>(id)] : 0.f);
  }
  v.unk = unk_;
  return v;
}

BpeTokenizer BpeTokenizer::from_files(const std::string& vocab_json, const std::string& merges_txt) {
  nlohmann::json v;
  try {
    v = nlohmann::json::parse(read_file(vocab_json));
  } catch (const nlohmann::json::exception& e) {
    TS_CHECK(false, vocab_json, ": not JSON: ", e.what());
  }
  TS_CHECK(v.is_object(), vocab_json, ": expected an object of token -> id");
  std::unordered_map<std::string, int64_t> vocab;
  for (const auto& [tok, id] : v.items()) {
    TS_CHECK(id.is_number_integer(), vocab_json, ": token '", tok, "' has id ", id.dump(), ", not an integer");
    vocab[tok] = json_id(id, concat(vocab_json, ": token '", tok, "'"));
  }
  std::vector<std::pair<std::string, std::string>> merges;
  std::istringstream in(read_file(merges_txt));
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    const auto sp = line.find(' ');
    TS_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < line.size() && line.find(' ', sp + 1) == std::string::npos,
             merges_txt, ":", line_no, ": expected two tokens separated by one space, found '", line, "'");
    merges.emplace_back(line.substr(0, sp), line.substr(sp + 1));
  }
  return BpeTokenizer(std::move(vocab), std::move(merges), vocab_json);
}

// A value of another type than the key wants (a string where a boolean belongs) is an error
// naming the file, through nlohmann's message, not an escape of json's own exception.
BpeTokenizer BpeTokenizer::from_tokenizer_json(const std::string& path) try {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    TS_CHECK(false, path, ": not JSON: ", e.what());
  }
  TS_CHECK(j.is_object() && j.contains("model") && j["model"].is_object(), path, ": no \"model\" object");
  const auto& m = j["model"];
  TS_CHECK(m.value("type", std::string()) == "BPE", path, ": model.type is ", m.value("type", std::string("missing")),
           "; only BPE models are read");
  // The pre-tokenizer (Note [Pre-tokenizer steps]) and the normalizer.
  std::vector<std::shared_ptr<const PreStep>> steps;
  Metaspace metaspace = Metaspace::kNone;
  bool metaspace_split = false, byte_level = false;
  if (j.contains("pre_tokenizer") && j["pre_tokenizer"].is_object()) {
    const auto& pt = j["pre_tokenizer"];
    std::vector<const nlohmann::json*> list;
    if (pt.value("type", std::string()) == "Sequence") {
      TS_CHECK(pt.contains("pretokenizers") && pt["pretokenizers"].is_array(), path, ": pre_tokenizer.pretokenizers must be a list");
      for (const auto& x : pt["pretokenizers"]) list.push_back(&x);
    } else {
      list.push_back(&pt);
    }
    for (size_t i = 0; i < list.size(); ++i) {
      const auto& x = *list[i];
      const std::string where = concat(path, ": pre_tokenizer step ", i);
      TS_CHECK(x.is_object(), where, " is not an object");
      const std::string type = x.value("type", std::string());
      if (type == "Metaspace") {  // Note [SentencePiece-style BPE]
        TS_CHECK(list.size() == 1, where, ": Metaspace is supported as the only pre-tokenizer");
        const std::string rep = x.value("replacement", kMeta);
        TS_CHECK(rep == kMeta, where, ": Metaspace replacement '", rep, "' is not supported (U+2581 is)");
        std::string scheme = x.value("prepend_scheme", std::string());
        if (scheme.empty()) scheme = x.value("add_prefix_space", true) ? "always" : "never";
        TS_CHECK(scheme == "always" || scheme == "first" || scheme == "never", where, ": Metaspace prepend_scheme \"", scheme,
                 "\" is not one of always, first, never");
        metaspace = scheme == "always" ? Metaspace::kAlways : scheme == "first" ? Metaspace::kFirst : Metaspace::kNever;
        metaspace_split = x.value("split", true);
      } else if (type == "ByteLevel") {
        byte_level = true;
        TS_CHECK(!x.value("add_prefix_space", false), where, ": ByteLevel add_prefix_space true is not supported");
        if (x.value("use_regex", true)) steps.push_back(step_of(PreStep::Kind::kGpt2));
      } else if (type == "Digits") {
        TS_CHECK(x.value("individual_digits", false), where, ": Digits without individual_digits is not supported");
        steps.push_back(step_of(PreStep::Kind::kDigits));
      } else if (type == "Split") {
        TS_CHECK(x.contains("pattern") && x["pattern"].is_object() && x["pattern"].contains("Regex") &&
                     x["pattern"]["Regex"].is_string(),
                 where, ": Split needs a {\"Regex\": ...} pattern");
        const std::string behavior = x.value("behavior", std::string("Isolated"));
        TS_CHECK(behavior == "Isolated" || behavior == "Removed", where, ": Split behavior \"", behavior,
                 "\" is not supported (Isolated and Removed are)");
        TS_CHECK(!x.value("invert", false), where, ": Split with invert true is not supported");
        steps.push_back(regex_step(x["pattern"]["Regex"].get<std::string>(), behavior == "Removed", where));
      } else {
        TS_CHECK(false, where, ": type \"", type, "\" is not supported (ByteLevel, Digits, Split, Metaspace)");
      }
    }
  }
  // The normalizer: none, NFC, SentencePiece's Prepend("▁") and Replace(" ", "▁"), or a
  // Sequence of those.
  bool nfc_norm = false, prepend = false, replace_space = false;
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    const auto& n = j["normalizer"];
    std::vector<const nlohmann::json*> list;
    if (n.is_object() && n.value("type", std::string()) == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array()) {
      for (const auto& x : n["normalizers"]) list.push_back(&x);
    } else {
      list.push_back(&n);
    }
    for (size_t i = 0; i < list.size(); ++i) {
      const auto& x = *list[i];
      const std::string where = concat(path, ": normalizer", list.size() > 1 ? concat(" step ", i) : std::string());
      const std::string type = x.is_object() ? x.value("type", std::string()) : std::string();
      if (type == "NFC") {
        nfc_norm = true;
      } else if (type == "Prepend") {
        TS_CHECK(x.value("prepend", std::string()) == kMeta && !replace_space, where,
                 ": Prepend is supported with \"\u2581\" before Replace");
        prepend = true;
      } else if (type == "Replace") {
        const bool space = x.contains("pattern") && x["pattern"].is_object() && x["pattern"].value("String", std::string()) == " " &&
                           x.value("content", std::string()) == kMeta;
        TS_CHECK(space, where, ": Replace is supported for \" \" -> \"\u2581\" only, found ", x.dump());
        replace_space = true;
      } else {
        TS_CHECK(false, where, ": ", x.is_object() ? concat("type \"", type, "\"") : x.dump(),
                 " is not supported (NFC, Prepend, Replace, and a Sequence of them are)");
      }
    }
  }
  TS_CHECK(m.contains("vocab") && m["vocab"].is_object(), path, ": model.vocab must be an object");
  std::unordered_map<std::string, int64_t> vocab;
  for (const auto& [tok, id] : m["vocab"].items()) {
    TS_CHECK(id.is_number_integer(), path, ": model.vocab['", tok, "'] is not an integer");
    vocab[tok] = json_id(id, concat(path, ": model.vocab['", tok, "']"));
  }
  std::vector<std::pair<std::string, std::string>> merges;
  if (m.contains("merges")) {
    TS_CHECK(m["merges"].is_array(), path, ": model.merges must be a list");
    for (size_t r = 0; r < m["merges"].size(); ++r) {
      const auto& e = m["merges"][r];
      if (e.is_string()) {
        const std::string s = e.get<std::string>();
        const auto sp = s.find(' ');
        TS_CHECK(sp != std::string::npos && sp > 0, path, ": model.merges[", r, "] = '", s, "' is not \"a b\"");
        merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else {
        TS_CHECK(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(), path, ": model.merges[", r,
                 "] is neither \"a b\" nor [a, b]");
        merges.emplace_back(e[0].get<std::string>(), e[1].get<std::string>());
      }
    }
  }
  // Model keys that change ids and that this reader does not compute are refused by name.
  TS_CHECK(!m.contains("dropout") || m["dropout"].is_null() || (m["dropout"].is_number() && m["dropout"].get<double>() == 0.0),
           path, ": model.dropout ", m.contains("dropout") ? m["dropout"].dump() : "", " (BPE-dropout) is not supported");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    TS_CHECK(!m.contains(k) || m[k].is_null() || (m[k].is_string() && m[k].get<std::string>().empty()), path, ": model.", k,
             " ", m.contains(k) ? m[k].dump() : "", " is not supported");
  }
  const bool byte_fallback = m.value("byte_fallback", false);
  const bool spm = metaspace != Metaspace::kNone || prepend || replace_space || byte_fallback;
  TS_CHECK(!spm || steps.empty(), path, ": a SentencePiece-style tokenizer (Metaspace, a \u2581 normalizer or byte_fallback) ",
           "with a ByteLevel, Digits or Split pre-tokenizer is not supported");
  TS_CHECK(spm || byte_level, path, ": a byte-level BPE without a pre_tokenizer is not supported (add ByteLevel)");
  BpeTokenizer t(std::move(vocab), std::move(merges), path, spm);
  // GPT-2's pattern alone is the default pipeline (pre_ empty).
  if (!(steps.size() == 1 && steps[0]->kind == PreStep::Kind::kGpt2)) t.pre_ = std::move(steps);
  t.nfc_ = nfc_norm;
  t.prepend_ = prepend;
  t.replace_space_ = replace_space;
  t.metaspace_ = metaspace;
  t.metaspace_split_ = metaspace_split;
  t.byte_fallback_ = byte_fallback;
  t.fuse_unk_ = m.value("fuse_unk", false);
  t.ignore_merges_ = m.value("ignore_merges", false);
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    const auto it = t.vocab_.find(m["unk_token"].get<std::string>());
    if (it != t.vocab_.end()) t.unk_ = it->second;
  }
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    // Added token ids index the id table: each must lie near the vocabulary (max_token_id), and
    // each content and each id may stand for one token only. A repeat of the same (content, id)
    // is skipped; a content listed with two ids, or an id with two contents (among the added
    // tokens or against the model's vocabulary), is refused: which one `tokenizers` would keep
    // depends on its version, and encode and decode would disagree.
    const int64_t bound = max_token_id(t.vocab_size() + static_cast<int64_t>(j["added_tokens"].size()));
    std::unordered_set<std::string> seen;
    for (size_t i = 0; i < j["added_tokens"].size(); ++i) {
      const auto& a = j["added_tokens"][i];
      TS_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_integer() && a.contains("content") &&
                   a["content"].is_string(),
               path, ": added_tokens[", i, "] needs an integer id and a string content");
      const std::string content = a["content"].get<std::string>();
      const int64_t id = json_id(a["id"], concat(path, ": added_tokens[", i, "] (\"", content, "\")"));
      TS_CHECK(!content.empty(), path, ": added_tokens[", i, "] (id ", id, ") has an empty content");
      // Added tokens match literally, before normalization; the flags that say otherwise are
      // refused by name (a normalizer-free tokenizer matches normalized tokens alike).
      for (const char* k : {"single_word", "lstrip", "rstrip"}) {
        TS_CHECK(!a.value(k, false), path, ": added_tokens[", i, "] (\"", content, "\") has ", k, " true, which is not supported");
      }
      TS_CHECK(!a.value("normalized", false) || (!t.nfc_ && !t.prepend_ && !t.replace_space_), path, ": added_tokens[", i,
               "] (\"", content, "\") has normalized true with a normalizer, which is not supported");
      TS_CHECK(id >= 0 && id <= bound, path, ": added_tokens[", i, "] (\"", content, "\") has id ", id, ", outside [0, ",
               bound, "] (", t.vocab_size(), " ids in the vocabulary)");
      if (const auto it = t.vocab_.find(content); it != t.vocab_.end()) {
        TS_CHECK(it->second == id, path, ": added_tokens[", i, "] (\"", content, "\") has id ", id, ", but \"", content,
                 "\" is token ", it->second, seen.count(content) ? " of an earlier added token" : " of the vocabulary");
      }
      if (id < t.vocab_size()) {
        const std::string& other = t.id_to_token_[static_cast<size_t>(id)];
        TS_CHECK(other.empty() || other == content, path, ": added_tokens[", i, "] (\"", content, "\") has id ", id,
                 ", which is already \"", other, "\"");
      }
      if (!seen.insert(content).second) continue;  // the same token again
      if (id >= t.vocab_size()) t.id_to_token_.resize(static_cast<size_t>(id + 1));
      t.id_to_token_[static_cast<size_t>(id)] = content;
      t.vocab_[content] = id;
      t.added_.emplace_back(content, id);
      if (content == "<|endoftext|>") t.eos_ = id;
    }
  }
  // GPT-2's <|endoftext|> from the vocabulary may be among them: one entry per content.
  std::unordered_set<std::string> kept;
  t.added_.erase(std::remove_if(t.added_.begin(), t.added_.end(), [&](const auto& a) { return !kept.insert(a.first).second; }),
                 t.added_.end());
  t.index_added();
  // A TemplateProcessing post-processor (alone or in a Sequence) whose single-sequence template
  // starts with a special token: the BOS a prompt starts with.
  if (j.contains("post_processor") && j["post_processor"].is_object()) {
    std::vector<const nlohmann::json*> procs{&j["post_processor"]};
    if (j["post_processor"].value("type", std::string()) == "Sequence" && j["post_processor"].contains("processors") &&
        j["post_processor"]["processors"].is_array()) {
      procs.clear();
      for (const auto& x : j["post_processor"]["processors"]) procs.push_back(&x);
    }
    for (const auto* pp : procs) {
      if (!pp->is_object() || pp->value("type", std::string()) != "TemplateProcessing") continue;
      const auto& single = pp->contains("single") ? (*pp)["single"] : nlohmann::json();
      if (!single.is_array() || single.empty() || !single[0].is_object() || !single[0].contains("SpecialToken")) continue;
      const auto& st = single[0]["SpecialToken"];
      const std::string name = st.is_object() ? st.value("id", std::string()) : std::string();
      const auto specials = pp->contains("special_tokens") ? (*pp)["special_tokens"] : nlohmann::json();
      int64_t id = -1;
      if (specials.is_object() && specials.contains(name) && specials[name].is_object() && specials[name].contains("ids") &&
          specials[name]["ids"].is_array() && specials[name]["ids"].size() == 1 && specials[name]["ids"][0].is_number_integer()) {
        id = specials[name]["ids"][0].get<int64_t>();
      } else if (const auto it = t.vocab_.find(name); it != t.vocab_.end()) {
        id = it->second;
      }
      TS_CHECK(id >= 0 && id < t.vocab_size(), path, ": post_processor's template starts with \"", name,
               "\", which is not a token of the vocabulary");
      t.add_bos_ = id;
    }
  }
  return t;
} catch (const nlohmann::json::exception& e) {
  TS_CHECK(false, path, ": a value has the wrong type: ", e.what());
  throw;
}

namespace {
// A GGUF vocabulary: tokenizer.ggml.tokens as token -> id, and the control and user-defined
// tokens (token types 3 and 4), which match literally as added tokens.
struct GgufTokens {
  const nlohmann::json* tokens = nullptr;
  std::unordered_map<std::string, int64_t> vocab;
  std::vector<std::pair<std::string, int64_t>> special;
};

GgufTokens gguf_tokens(const io::gguf::File& f, const std::string& path) {
  const auto& md = f.header().metadata;
  TS_CHECK(md.contains("tokenizer.ggml.tokens") && md.at("tokenizer.ggml.tokens").is_array(), path,
           ": no tokenizer.ggml.tokens array");
  GgufTokens g;
  g.tokens = &md.at("tokenizer.ggml.tokens");
  const auto& tokens = *g.tokens;
  const nlohmann::json no_types = nlohmann::json::array();
  const auto& types = md.contains("tokenizer.ggml.token_type") ? md.at("tokenizer.ggml.token_type") : no_types;
  TS_CHECK(types.is_array() && (types.empty() || types.size() == tokens.size()), path, ": tokenizer.ggml.token_type has ",
           types.size(), " entries for ", tokens.size(), " tokens");
  for (size_t i = 0; i < tokens.size(); ++i) {
    TS_CHECK(tokens[i].is_string(), path, ": tokenizer.ggml.tokens[", i, "] is not a string");
    const std::string& tok = tokens[i].get_ref<const std::string&>();
    g.vocab.emplace(tok, static_cast<int64_t>(i));
    const int64_t type = types.empty() || !types[i].is_number_integer() ? 1 : types[i].get<int64_t>();
    if ((type == 3 || type == 4) && !tok.empty()) g.special.emplace_back(tok, static_cast<int64_t>(i));
  }
  return g;
}

// A token id from GGUF metadata `key`, or -1 where the key is missing; an id outside the
// vocabulary is an error naming the key.
int64_t gguf_token_id(const io::gguf::File& f, const std::string& path, const char* key, int64_t vocab) {
  if (!f.has(key)) return -1;
  const int64_t id = f.integer(key);
  TS_CHECK(id >= 0 && id < vocab, path, ": ", key, " ", id, " is outside the ", vocab, " tokens");
  return id;
}

bool gguf_flag(const io::gguf::File& f, const std::string& path, const char* key, bool dflt) {
  if (!f.has(key)) return dflt;
  const auto& v = f.header().metadata.at(key);
  TS_CHECK(v.is_boolean(), path, ": ", key, " is not a boolean: ", v.type_name());
  return v.get<bool>();
}
}  // namespace

void BpeTokenizer::take_gguf_specials(const io::gguf::File& f, const std::string& path, const nlohmann::json& tokens,
                                      const std::vector<std::pair<std::string, int64_t>>& special, bool add_bos_default) {
  // GGUF ids are the indexes of tokenizer.ggml.tokens. A string listed twice maps to its first id
  // (gguf_tokens), which left the later index out of the id table, and the table one short where
  // the last token was a repeat: every index gets its string back, so the table covers every id
  // the metadata or the model's embedding rows may name.
  if (id_to_token_.size() < tokens.size()) id_to_token_.resize(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (id_to_token_[i].empty()) id_to_token_[i] = tokens[i].get_ref<const std::string&>();
  }
  unk_ = gguf_token_id(f, path, "tokenizer.ggml.unknown_token_id", vocab_size());
  std::unordered_set<std::string> known;
  for (const auto& a : added_) known.insert(a.first);
  for (const auto& [tok, id] : special) {
    // A control token whose string an earlier index already holds is no added token: the string
    // encodes as that first id, as everywhere else.
    if (vocab_.at(tok) != id) continue;
    if (known.insert(tok).second) added_.emplace_back(tok, id);
  }
  index_added();
  if (const int64_t eos = gguf_token_id(f, path, "tokenizer.ggml.eos_token_id", vocab_size()); eos >= 0) eos_ = eos;
  // tokenizer.ggml.add_bos_token, llama.cpp's default where it is missing (SentencePiece
  // vocabularies add BOS, byte-level ones do not).
  const int64_t bos = gguf_token_id(f, path, "tokenizer.ggml.bos_token_id", vocab_size());
  add_bos_ = gguf_flag(f, path, "tokenizer.ggml.add_bos_token", add_bos_default) ? bos : -1;
}

// GGUF's SentencePiece tokenizer (Note [SentencePiece-style BPE]).
BpeTokenizer BpeTokenizer::from_gguf_spm(const io::gguf::File& f, const std::string& path) {
  const auto& md = f.header().metadata;
  GgufTokens g = gguf_tokens(f, path);
  const auto& tokens = *g.tokens;
  TS_CHECK(md.contains("tokenizer.ggml.scores") && md.at("tokenizer.ggml.scores").is_array() &&
               md.at("tokenizer.ggml.scores").size() == tokens.size(),
           path, ": tokenizer.ggml.model \"llama\" needs tokenizer.ggml.scores, one per token");
  const auto& scores = md.at("tokenizer.ggml.scores");
  std::vector<double> score(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    TS_CHECK(scores[i].is_number(), path, ": tokenizer.ggml.scores[", i, "] is not a number");
    score[i] = scores[i].get<double>();
  }
  // Merges from the scores: each split of a token into two tokens, ranked by the token's score
  // (equal scores share a rank: the leftmost pair merges first, as in llama.cpp).
  std::vector<double> distinct(score);
  std::sort(distinct.begin(), distinct.end(), std::greater<double>());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  std::vector<std::tuple<int, int64_t, std::string, std::string>> cand;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string& tok = tokens[i].get_ref<const std::string&>();
    const auto cps = code_points(tok);
    if (cps.size() < 2) continue;
    const int rank = static_cast<int>(std::lower_bound(distinct.begin(), distinct.end(), score[i], std::greater<double>()) -
                                      distinct.begin());
    for (size_t k = 1; k < cps.size(); ++k) {
      const std::string l = tok.substr(0, cps[k].begin), r = tok.substr(cps[k].begin);
      if (g.vocab.count(l) && g.vocab.count(r)) cand.emplace_back(rank, static_cast<int64_t>(i), l, r);
    }
  }
  std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) {
    return std::get<0>(a) != std::get<0>(b) ? std::get<0>(a) < std::get<0>(b) : std::get<1>(a) < std::get<1>(b);
  });
  std::vector<std::pair<std::string, std::string>> merges;
  std::vector<int> ranks;
  merges.reserve(cand.size());
  ranks.reserve(cand.size());
  for (auto& [rank, id, l, r] : cand) {
    merges.emplace_back(std::move(l), std::move(r));
    ranks.push_back(rank);
  }
  BpeTokenizer t(std::move(g.vocab), std::move(merges), path, /*spm=*/true, std::move(ranks));
  t.byte_fallback_ = true;
  t.fuse_unk_ = true;
  t.replace_space_ = true;
  t.prepend_ = gguf_flag(f, path, "tokenizer.ggml.add_space_prefix", true);  // llama.cpp's default: true
  t.take_gguf_specials(f, path, tokens, g.special, /*add_bos_default=*/true);
  return t;
}

BpeTokenizer BpeTokenizer::from_gguf(const std::string& path) {
  const io::gguf::File f(path);
  const auto& md = f.header().metadata;
  const std::string model = f.has("tokenizer.ggml.model") ? f.string("tokenizer.ggml.model") : "";
  if (model == "llama") return from_gguf_spm(f, path);
  TS_CHECK(model == "gpt2", path, ": tokenizer.ggml.model is \"", model,
           "\"; torchspeed reads byte-level BPE (\"gpt2\") and SentencePiece (\"llama\") tokenizers of GGUF files");
  const std::string pre = f.has("tokenizer.ggml.pre") ? f.string("tokenizer.ggml.pre") : "default";
  TS_CHECK(pre == "default" || pre == "gpt-2" || pre == "gpt2" || pre == "smollm" || pre == "llama-bpe" || pre == "llama3" ||
               pre == "qwen2",
           path, ": tokenizer.ggml.pre \"", pre,
           "\" is not supported yet (default, gpt-2, smollm, llama-bpe (Llama 3) and qwen2 are)");
  GgufTokens g = gguf_tokens(f, path);
  std::vector<std::pair<std::string, std::string>> merges;
  if (md.contains("tokenizer.ggml.merges")) {
    const auto& ms = md.at("tokenizer.ggml.merges");
    TS_CHECK(ms.is_array(), path, ": tokenizer.ggml.merges is not an array");
    for (size_t r = 0; r < ms.size(); ++r) {
      TS_CHECK(ms[r].is_string(), path, ": tokenizer.ggml.merges[", r, "] is not a string");
      const std::string& m = ms[r].get_ref<const std::string&>();
      const auto sp = m.find(' ');
      TS_CHECK(sp != std::string::npos && sp > 0, path, ": tokenizer.ggml.merges[", r, "] = '", m, "' is not \"a b\"");
      merges.emplace_back(m.substr(0, sp), m.substr(sp + 1));
    }
  }
  BpeTokenizer t(std::move(g.vocab), std::move(merges), path);
  if (pre == "smollm") t.pre_ = {step_of(PreStep::Kind::kDigits), step_of(PreStep::Kind::kGpt2)};
  if (pre == "llama-bpe" || pre == "llama3") {
    t.pre_ = {regex_step(kLlama3Pattern, false, path)};
    t.ignore_merges_ = true;  // as Llama 3's tokenizer.json
  }
  if (pre == "qwen2") {
    t.pre_ = {regex_step(kQwen2Pattern, false, path)};
    t.nfc_ = true;  // as Qwen2's tokenizer.json
  }
  t.take_gguf_specials(f, path, *g.tokens, g.special, /*add_bos_default=*/false);
  return t;
}

BpeTokenizer BpeTokenizer::from_folder(const std::string& dir) {
  namespace fs = std::filesystem;
  if (fs::exists(fs::path(dir) / "tokenizer.json")) return from_tokenizer_json((fs::path(dir) / "tokenizer.json").string());
  TS_CHECK(fs::exists(fs::path(dir) / "vocab.json") && fs::exists(fs::path(dir) / "merges.txt"), dir,
           ": no tokenizer.json, nor vocab.json and merges.txt");
  return from_files((fs::path(dir) / "vocab.json").string(), (fs::path(dir) / "merges.txt").string());
}

}  // namespace torchspeed::data
