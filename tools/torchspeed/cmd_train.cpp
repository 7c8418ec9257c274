// `torchspeed train --config FILE [--data PATH] [-n RANKS] [--out DIR] [--set KEY=VALUE ...]
// [--resume]`: trains the GPT of the config's "model" section with the engine on a text corpus,
// shows progress on rank 0, evaluates, writes metrics.csv and loss.svg, saves sharded training
// checkpoints to OUT/checkpoints (every train.checkpoint_interval steps, at the end, and on
// Ctrl-C after the current step) and the full model to OUT/model. --resume continues exactly
// from OUT/checkpoints/latest. Launches its ranks itself when not under mpirun.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <pthread.h>
#include <thread>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <map>
#include <optional>
#include <fstream>
#include <unistd.h>

#include "commands.h"
#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/checkpoint/io_names.h"
#include "torchspeed/config/json_reader.h"
#include "torchspeed/data/text.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/engine/trainer.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/models/lora.h"
#include "torchspeed/monitor/metrics.h"
#include "torchspeed/monitor/observers.h"
#include "torchspeed/precision/advice.h"
#include "torchspeed/base/cpu.h"
#include "torchspeed/base/error.h"
#include "torchspeed/launch/launcher.h"
#include "torchspeed/base/logging.h"
#include "torchspeed/base/memory_counter.h"

namespace torchspeed::cli {
namespace {

std::atomic<bool> g_stop{false};

// Ctrl-C / SIGTERM: blocked in every thread (they inherit the mask from the main thread, so
// OpenMP, oneDNN and MPI threads are never interrupted mid-kernel) and received by one thread
// with sigwait, which sets the flag the training loop checks after each step.
// Logs each checkpoint the loop saves (rank 0).
class LoggedCheckpoints final : public monitor::StepObserver {
 public:
  void on_step(const monitor::StepReport&, double) override {}
  void on_checkpoint(int64_t, const std::string& path) override { log::info0("saved ", path); }
};

void watch_stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    int sig = 0;
    sigwait(&set, &sig);
    g_stop = true;
  }).detach();
}

struct TrainSection {
  int64_t steps = 100, eval_interval = 50, eval_batches = 4, log_interval = 10;
  int64_t checkpoint_interval = 0;  // 0: only at the end
  // Biases and norm weights never take weight decay (GPT-2/Megatron); embeddings neither when set.
  bool no_decay_embeddings = false;
};

struct DataSection {
  std::string path = data::kDefaultCorpus;
  double val_fraction = 0.1;
  std::string tokenizer = "bytes";  // or a BPE tokenizer's tokenizer.json / folder
  // Tokens per training sequence (0: model.seq_len). Shorter than the model's context: a
  // fine-tune on short samples keeps the model's full context for serving.
  int64_t seq_len = 0;
};

TrainSection read_train(const nlohmann::json& j) {
  config::Diagnostics d;
  config::JsonReader r(j, "train", d);
  TrainSection t;
  t.steps = r.get_int("steps", t.steps, 1);
  t.eval_interval = r.get_int("eval_interval", t.eval_interval, 1);
  t.eval_batches = r.get_int("eval_batches", t.eval_batches, 1);
  t.log_interval = r.get_int("log_interval", t.log_interval, 1);
  t.checkpoint_interval = r.get_int("checkpoint_interval", t.checkpoint_interval, 0);
  t.no_decay_embeddings = r.get_bool("no_decay_embeddings", t.no_decay_embeddings);
  r.finish();
  if (!d.errors.empty()) throw config::ConfigError(d.errors);
  return t;
}

DataSection read_data(const nlohmann::json& j) {
  config::Diagnostics d;
  config::JsonReader r(j, "data", d);
  DataSection s;
  s.path = r.get_string("path", s.path);
  s.val_fraction = r.get_double("val_fraction", s.val_fraction, 1e-6, 0.5);
  s.tokenizer = r.get_string("tokenizer", s.tokenizer);
  s.seq_len = r.get_int("seq_len", s.seq_len, 0, 1 << 24);
  r.finish();
  if (!d.errors.empty()) throw config::ConfigError(d.errors);
  return s;
}

std::string default_out_dir() {
  std::time_t now = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof(buf), "runs/%Y%m%d-%H%M%S", std::localtime(&now));
  return buf;
}


}  // namespace

// --set a.b.c=VALUE: VALUE as JSON when it parses (numbers, true, {...}), else as a string.
void apply_override(nlohmann::json& j, const std::string& kv) {
  const auto eq = kv.find('=');
  TS_CHECK(eq != std::string::npos && eq > 0, "--set '", kv, "': expected KEY=VALUE, e.g. train.steps=200");
  const std::string key = kv.substr(0, eq), raw = kv.substr(eq + 1);
  nlohmann::json value;
  try {
    value = nlohmann::json::parse(raw);
  } catch (const std::exception&) {
    value = raw;
  }
  nlohmann::json* node = &j;
  size_t start = 0;
  while (true) {
    const auto dot = key.find('.', start);
    const std::string part = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    TS_CHECK(!part.empty(), "--set '", kv, "': empty key segment");
    if (dot == std::string::npos) {
      (*node)[part] = value;
      return;
    }
    if (!node->contains(part) || !(*node)[part].is_object()) (*node)[part] = nlohmann::json::object();
    node = &(*node)[part];
    start = dot + 1;
  }
}

Runner add_train(CLI::App& app, const Invocation& inv) {
  auto* cmd = app.add_subcommand("train", "Train the GPT of a config on a text corpus");
  struct Opts {
    std::string config, data, out, init_from;
    int ranks = 1;
    bool resume = false;
    std::vector<std::string> sets;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("--config,-c", o->config, "DeepSpeed config + model/data/train sections")->required();
  cmd->add_option("--data", o->data, "Text file or folder (default: the config's data.path, else the fortunes corpus)");
  cmd->add_option("-n,--num-ranks", o->ranks, "Ranks to launch when not under mpirun")->check(CLI::Range(1, 1024));
  cmd->add_option("--out", o->out, "Output folder (default runs/<date-time>)");
  cmd->add_option("--set", o->sets, "Override a config key by its dotted path, e.g. --set train.steps=200");
  cmd->add_option("--init-from", o->init_from,
                  "Start from this model's weights: a Hugging Face GPT-2 folder, or anything `generate` loads; its shape fills "
                  "the config's model section, and its tokenizer is used unless data.tokenizer is set");
  cmd->add_flag("--resume", o->resume, "Continue from OUT/checkpoints/latest (exactly: data order, RNG, optimizer)");
  return [o, &inv]() -> int {
    if (o->out.empty()) o->out = default_out_dir();
    if (!launcher::under_launcher() && o->ranks > 1) {
      // Note [Relaunching a command]: the user's arguments go to the ranks as given, with the
      // output folder this process chose (its default is a time stamp, which the ranks must share).
      launcher::Relaunch r;
      r.num_ranks = o->ranks, r.self_path = inv.self_path, r.args = inv.args;
      r.drop = {"--out"};
      r.append = {"--out", o->out};
      // Ranks get a pseudo-terminal from mpirun; the progress style follows the user's stdout.
      r.extra_env.push_back(concat("TORCHSPEED_STDOUT_TTY=", ::isatty(1) ? 1 : 0));
      // Ctrl-C: ask the ranks to stop after their current step and save (see stop_file below).
      const std::string stop = o->out + "/STOP";
      std::filesystem::remove(stop);  // a stale request from an earlier run
      r.how = launcher::Relaunch::How::kShielded;
      r.on_interrupt = [stop] {
        std::filesystem::create_directories(std::filesystem::path(stop).parent_path());
        std::ofstream(stop) << "stop\n";
        std::printf("\nCtrl-C: stopping after the current step and saving a checkpoint (Ctrl-C again to abort)\n");
        std::fflush(stdout);
      };
      return launcher::relaunch_under_mpirun(r);
    }
    watch_stop_signals();  // before any thread exists
    const Runtime& rt = init();

    nlohmann::json j = config::read_json_file(o->config);
    for (const auto& s : o->sets) apply_override(j, s);
    // --init-from: the model's shape comes from the checkpoint; a key the config also gives must
    // agree (dropout may differ: it is a training setting; data.seq_len trains on shorter
    // sequences than the model's context).
    std::optional<checkpoint::Model> init;
    if (!o->init_from.empty()) {
      init = checkpoint::load_model(o->init_from);
      nlohmann::json model = j.value("model", nlohmann::json::object());
      const nlohmann::json given = init->config.value("model", nlohmann::json::object());  // named: items() refers to it
      for (const auto& [k, v] : given.items()) {
        if (model.contains(k) && k != "dropout" && model.at(k) != v) {
          TS_CHECK(false, o->config, ": model.", k, " is ", model.at(k).dump(), " but the model of --init-from ", o->init_from,
                   " has ", v.dump(), "; leave it out of the config (--init-from sets it)");
        }
        if (!model.contains(k)) model[k] = v;
      }
      j["model"] = model;
      const auto data_j = j.value("data", nlohmann::json::object());
      if (!data_j.is_object() || !data_j.contains("tokenizer")) {
        j["data"]["tokenizer"] = data::tokenizer_of_model(o->init_from, *init)->source();
      }
    }
    // A tokenizer path is saved absolute in checkpoints and the model's config.json, so that
    // generate, serve and convert find it from anywhere.
    if (j.contains("data") && j["data"].is_object() && j["data"].contains("tokenizer") && j["data"]["tokenizer"].is_string()) {
      const std::string t = j["data"]["tokenizer"].get<std::string>();
      if (t != "bytes" && !t.empty()) j["data"]["tokenizer"] = std::filesystem::absolute(t).lexically_normal().string();
    }
    config::WorldShape shape;
    shape.world_size = rt.world_size;
    // "auto" values (Hugging Face configs): the steps and hidden size from our own sections.
    config::AutoValues autos;
    autos.max_steps = read_train(j.value("train", nlohmann::json::object())).steps;
    autos.hidden_size = models::GPTConfig::from_json(j.value("model", nlohmann::json::object())).d_model;
    autos.source = "torchspeed train, as the Hugging Face Trainer's default";
    config::Config cfg = config::Config::parse(j, shape, autos);
    for (const auto& w : cfg.warnings) log::warn0(o->config, ": ", w);
    const auto gpt = models::GPTConfig::from_json(cfg.sections.value("model", nlohmann::json::object()));
    // An autotuning experiment also measures the peak of LibTorch's CPU allocations while its
    // steps are timed (what `torchspeed plan` predicts), counted from before the model exists.
    CountingAllocator* counter = cfg.autotuning.enabled ? &count_cpu_allocations() : nullptr;
    DataSection ds = read_data(cfg.sections.value("data", nlohmann::json::object()));
    if (!o->data.empty()) ds.path = o->data;
    const TrainSection ts = read_train(cfg.sections.value("train", nlohmann::json::object()));
    // LoRA (the config's "lora" section, PEFT's keys): the base from --init-from frozen, an
    // adapter trained.
    std::shared_ptr<const models::LoraOptions> lora;
    if (cfg.sections.contains("lora")) {
      lora = std::make_shared<const models::LoraOptions>(models::LoraOptions::from_json(cfg.sections.at("lora"), gpt));
      TS_CHECK(init, o->config, ": lora: an adapter is trained on a base model; give it with --init-from");
      TS_CHECK(cfg.pp == 1 && cfg.tp == 1, o->config, ": lora: runs with data parallelism and ZeRO (pipeline stages ", cfg.pp,
               ", tensor parallelism ", cfg.tp, " are not supported with an adapter)");
    }
    const data::TokenizerPtr tokenizer = data::load_tokenizer(ds.tokenizer);
    TS_CHECK(gpt.vocab >= tokenizer->vocab_size(), "model.vocab is ", gpt.vocab, " but the tokenizer (", tokenizer->source(), ") has ",
             tokenizer->vocab_size(), " tokens: raise model.vocab to at least that");

    const int64_t seq = ds.seq_len > 0 ? ds.seq_len : gpt.seq_len;
    TS_CHECK(seq <= gpt.seq_len, o->config, ": data.seq_len ", seq, " is longer than the model's context model.seq_len ",
             gpt.seq_len);
    models::GPTConfig trained = gpt;  // the FLOPs of the sequences trained on
    trained.seq_len = seq;
    auto corpus = data::TextCorpus::load(ds.path, ds.val_fraction, seq + 1, tokenizer.get());
    const double bigram = corpus.bigram_entropy();
    torch::manual_seed(static_cast<uint64_t>(cfg.seed));
    // From the spec: with pipeline.stages > 1 each rank builds only its stage's layers.
    // With tensor_parallel.tp_size > 1 the layers split over the grid's tensor-parallel group.
    auto groups = make_groups(rt, cfg, static_cast<int>(gpt.moe.ep_size));
    models::InitTensors init_tensors;
    if (init) {
      auto m = std::make_shared<std::map<std::string, at::Tensor>>();
      for (const auto& [name, t] : init->params) (*m)[name] = t;
      init_tensors = m;
    }
    // Sequence parallelism (DeepSpeed-Ulysses) and ALST's tiling change how the layers run, not
    // their weights.
    TS_CHECK(seq % cfg.sp == 0, o->config, ": data.seq_len ", seq, " is not a multiple of sequence_parallel_size ", cfg.sp,
             " (each rank takes an equal shard of every sequence)");
    nn::StackSpec spec = models::gpt_spec(gpt, static_cast<uint64_t>(cfg.seed), groups.tp, init_tensors, lora, groups.ep);
    spec = models::sequence_parallel(std::move(spec), gpt, groups.sp);
    spec = models::tiled(std::move(spec), gpt, cfg.torchspeed.tiled_mlp, cfg.torchspeed.tiled_loss);
    auto engine = initialize(groups, spec, cfg, {no_weight_decay_group(ts.no_decay_embeddings)});
    // FLOPs per token: 6 N + attention; with LoRA the frozen base takes no weight gradients (its
    // 2 N of them), the adapter's parameters all 6.
    auto flops_per_token = [&](const models::GPTConfig& c) {
      double f = c.flops_per_token();
      if (lora) f += -2.0 * static_cast<double>(c.num_params()) + 6.0 * static_cast<double>(engine->num_parameters());
      return f;
    };
    engine->set_flops_per_sample(flops_per_token(trained) * static_cast<double>(seq));
    engine->set_progress_report(false);  // the progress line below, every train.log_interval steps
    const auto& dp = engine->groups().dp;
    const int64_t micro = cfg.train_micro_batch_size_per_gpu;
    // A sequence-parallel group's ranks read the same sequences (the engine keeps each rank's shard).
    const int replica = dp->rank() / cfg.sp, replicas = cfg.replicas();
    data::TextLoader loader(corpus.train, seq, micro, replica, replicas, static_cast<uint64_t>(cfg.seed));

    // MFU against this machine's measured GEMM rate in the compute dtype, on every rank's cores.
    // The other dtype is measured too: a precision several times slower on this CPU is named.
    const bool bf16_compute = engine->compute_dtype() == at::kBFloat16;
    const double fp32_rate = cpu::measure_gemm_gflops("fp32", 512);
    const double bf16_rate = cpu::measure_gemm_gflops("bf16", 512);
    const double peak = (bf16_compute ? bf16_rate : fp32_rate) * 1e9 * rt.world_size;
    if (auto advice = precision::precision_advice(bf16_compute, fp32_rate, bf16_rate)) {
      if (advice->warning) {
        log::warn0(advice->message);
      } else {
        log::info0(advice->message);
      }
    }
    std::filesystem::create_directories(o->out);
    if (rt.is_rank0()) {
      const std::string family =
          cfg.sections.value("model", nlohmann::json::object()).value("family", std::string(gpt.rope() ? "decoder" : "GPT"));
      std::printf("torchspeed train: %s %ld layers, d_model %ld, %ld heads (%ld KV), seq %ld (context %ld): %.2fM parameters\n",
                  family.c_str(), static_cast<long>(gpt.n_layer), static_cast<long>(gpt.d_model), static_cast<long>(gpt.n_head),
                  static_cast<long>(gpt.kv_heads()), static_cast<long>(seq), static_cast<long>(gpt.seq_len),
                  gpt.num_params() / 1e6);
      std::printf("  %d ranks (dp %d x pp %d x tp %d), ZeRO stage %d, %s, batch %ld = %ld micro x %ld accumulation x %d dp%s\n",
                  rt.world_size, dp->size(), cfg.pp, cfg.tp, cfg.zero.stage,
                  precision::precision_name(engine->precision()), static_cast<long>(cfg.train_batch_size),
                  static_cast<long>(micro), static_cast<long>(cfg.gradient_accumulation_steps), replicas,
                  cfg.sp > 1 ? concat(" / sp ", cfg.sp).c_str() : "");
      if (cfg.sp > 1) {
        std::printf("  sequence parallel (Ulysses) over %d ranks: %ld tokens each of every %ld-token sequence, %ld of %ld "
                    "attention heads each\n",
                    cfg.sp, static_cast<long>(seq / cfg.sp), static_cast<long>(seq), static_cast<long>(gpt.n_head / cfg.sp),
                    static_cast<long>(gpt.n_head));
      }
      if (cfg.torchspeed.tiled_mlp > 1 || cfg.torchspeed.tiled_loss > 1) {
        std::printf("  tiled (ALST): MLP over %ld slices, LM head and loss over %ld slices of each sequence\n",
                    static_cast<long>(std::max<int64_t>(1, cfg.torchspeed.tiled_mlp)),
                    static_cast<long>(std::max<int64_t>(1, cfg.torchspeed.tiled_loss)));
      }
      std::printf("  data: %s, %zu files, %.2f MB of text; tokenizer %s: %.2fM train / %.2fM validation tokens\n",
                  ds.path.c_str(), corpus.files.size(), corpus.bytes / 1e6, tokenizer->source().c_str(),
                  corpus.train.size() / 1e6, corpus.val.size() / 1e6);
      if (init) std::printf("  initialized from %s\n", init->source.c_str());
      if (gpt.moe.enabled()) {
        const models::MoEConfig m = gpt.experts();
        const std::string drop = m.drop_tokens ? concat("capacity factor ", m.capacity_factor, " (tokens past it dropped)")
                                               : std::string("dropless");
        const std::string ep = m.ep_size > 1 ? concat(", expert parallel over ", m.ep_size, " ranks (", m.num_experts / m.ep_size,
                                                      " experts each)")
                                             : std::string();
        std::printf("  mixture of experts: %ld experts of d_ff %ld per block, %ld per token, %s, load-balancing loss x %g: "
                    "%.2fM parameters active per token%s\n",
                    static_cast<long>(m.num_experts), static_cast<long>(m.d_ff), static_cast<long>(m.k), drop.c_str(),
                    m.aux_loss_coef, gpt.active_params() / 1e6, ep.c_str());
      }
      if (lora) {
        std::string targets;
        for (const auto& t : lora->target_modules) targets += (targets.empty() ? "" : ",") + t;
        std::printf("  LoRA: r %ld, alpha %g%s on %s: %.3fM trainable parameters, the base's %.2fM frozen\n",
                    static_cast<long>(lora->r), lora->alpha, lora->rslora ? " (rsLoRA)" : "", targets.c_str(),
                    static_cast<double>(engine->num_parameters()) / 1e6, gpt.num_params() / 1e6);
      }
      std::printf("  bigram baseline (entropy of the next token given the previous one): %.4f nats\n", bigram);
      std::printf("  output: %s\n", o->out.c_str());
      std::fflush(stdout);
    }

    // The loop (engine/trainer.h): evaluation and checkpoint cadence, resume, the stop agreement.
    const std::string checkpoints = o->out + "/checkpoints";
    TrainerOptions topt;
    topt.steps = ts.steps;
    topt.eval_interval = ts.eval_interval;
    topt.log_interval = ts.log_interval;
    topt.checkpoint_interval = ts.checkpoint_interval;
    topt.checkpoint_dir = checkpoints;
    topt.tokens_per_step = cfg.train_batch_size * seq;
    topt.flops_per_token = flops_per_token(trained);
    topt.peak_flops = peak;
    // Stop cleanly on a signal or when OUT/STOP exists (written by the launching CLI on Ctrl-C;
    // `touch OUT/STOP` works under any launcher): every rank agrees after the step.
    topt.stop_file = o->out + "/STOP";
    topt.stop_requested = [] { return g_stop.load(); };
    Trainer trainer(*engine,
                    TrainData::of(loader, [&] { return data::TextLoader(corpus.val, seq, micro, replica, replicas, 12345); },
                                  ts.eval_batches),
                    topt);
    // Sharded, exactly resumable training state; at the end also the full model for generate.
    auto save_model = [&] {
      auto params = engine->master_params();  // collective
      if (!rt.is_rank0()) return;
      nlohmann::json saved = j;
      saved["model"] = gpt.to_json();
      if (lora) {
        // The adapter in PEFT's format (OUT/adapter: PeftModel.from_pretrained and `serve
        // --lora-modules` read it), and the base with the adapter merged in (OUT/model).
        const checkpoint::peft::Adapter adapter = models::lora_adapter_of(params, gpt, *lora);
        checkpoint::peft::save(o->out + "/adapter", adapter, gpt, std::filesystem::absolute(o->init_from).string());
        params = models::merge_lora(init->params, adapter, gpt);
      }
      checkpoint::save_consolidated(o->out + "/model", params, saved, engine->global_step());
    };
    if (o->resume) {
      if (auto loaded = trainer.resume()) {
        if (rt.is_rank0()) {
          std::printf("  resumed from %s at step %ld\n", loaded->path.c_str(), static_cast<long>(trainer.step()));
          // Another data-parallel size (an elastic restart, Note [Elastic restart]): say how the
          // global batch carries over.
          const nlohmann::json saved = config::read_json_file(loaded->path + "/manifest.json");
          const int64_t saved_dp = saved.at("grid").value("dp", static_cast<int64_t>(dp->size()));
          const int64_t saved_batch = saved.at("config").value("train_batch_size", cfg.train_batch_size);
          if (saved_dp != dp->size()) {
            std::printf("  saved at dp %ld, resumed at dp %d: global batch %ld %s (%ld micro x %ld accumulation x %d dp)\n",
                        static_cast<long>(saved_dp), dp->size(), static_cast<long>(cfg.train_batch_size),
                        saved_batch == cfg.train_batch_size ? "kept" : concat("instead of ", saved_batch).c_str(),
                        static_cast<long>(micro), static_cast<long>(cfg.gradient_accumulation_steps), dp->size());
          }
        }
      } else if (rt.is_rank0()) {
        std::printf("  --resume: no checkpoint in %s yet; starting at step 0\n", checkpoints.c_str());
      }
      std::fflush(stdout);
    }
    // Rank 0 writes metrics.csv (a resumed run keeps its earlier rows) and the progress line; the
    // periodic checkpoints are logged.
    std::shared_ptr<monitor::CsvObserver> csv;
    if (rt.is_rank0()) {
      csv = std::make_shared<monitor::CsvObserver>(o->out + "/metrics.csv", trainer.step(), ts.log_interval, ts.steps);
      trainer.add_observer(csv);
      trainer.add_observer(std::make_shared<monitor::ProgressObserver>(ts.steps, ts.log_interval, trainer.step()));
      trainer.add_observer(std::make_shared<LoggedCheckpoints>());
    }
    // An autotuning experiment's allocation peak counts its timed steps only.
    if (counter) {
      trainer.add_observer(std::make_shared<monitor::StepCallback>([counter, &cfg](const monitor::StepReport& r) {
        if (r.step == cfg.autotuning.start_profile_step) counter->reset_peak();
      }));
    }
    const auto start = std::chrono::steady_clock::now();
    const TrainResult result = trainer.run();
    const int64_t step = result.step;
    if (result.interrupted && rt.is_rank0()) {
      std::printf("\ninterrupted: saving the checkpoint of step %ld\n", static_cast<long>(step));
    }
    if (result.autotuning_done) {
      at::Tensor peak_bytes = at::full({1}, static_cast<double>(counter->peak()), at::kDouble);
      engine->groups().world->all_reduce(peak_bytes, comm::ReduceOp::kMax);
      if (rt.is_rank0()) {
        nlohmann::json m = engine->autotuning_metrics();
        m["peak_allocated_bytes"] = peak_bytes.item<double>();  // the most of any rank
        m["peak_allocated_measured"] = "LibTorch's CPU allocator, the most bytes live on any rank during the timed steps";
        const std::string metric_path = cfg.autotuning.metric_path.empty() ? "autotuning_metric.json" : cfg.autotuning.metric_path;
        checkpoint::write_file_atomic(metric_path, m.dump(2) + "\n");
        std::printf("autotuning experiment: %.1f ms per step, %.1f samples/s (steps %ld-%ld timed), peak %.1f MB allocated on a rank; metrics in %s; "
                    "no checkpoint (as DeepSpeed, which exits here)\n",
                    m.at("latency").get<double>(), m.at("throughput").get<double>(),
                    static_cast<long>(cfg.autotuning.start_profile_step + 1), static_cast<long>(cfg.autotuning.end_profile_step),
                    peak_bytes.item<double>() / 1e6, metric_path.c_str());
      }
      engine.reset();
      shutdown();
      return 0;
    }
    trainer.save();
    save_model();
    if (rt.is_rank0()) std::filesystem::remove(o->out + "/STOP");
    if (rt.is_rank0()) {
      monitor::write_loss_svg(o->out + "/loss.svg", csv->history(), bigram, "GPT training loss (torchspeed)");
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (result.interrupted) {
        std::printf("stopped at step %ld after %s\n", static_cast<long>(step), monitor::format_duration(secs).c_str());
      } else {
        std::printf("done: %ld steps in %s; validation loss %.4f vs bigram baseline %.4f (%s)\n",
                    static_cast<long>(step), monitor::format_duration(secs).c_str(), *result.val_loss, bigram,
                    *result.val_loss < bigram ? "below" : "NOT below");
      }
      if (lora) std::printf("adapter (PEFT's format): %s/adapter; model: the base with it merged\n", o->out.c_str());
      std::printf("model: %s/model, checkpoint: %s/checkpoints (--resume continues), metrics: %s/metrics.csv, "
                  "plot: %s/loss.svg\n", o->out.c_str(), o->out.c_str(), o->out.c_str(), o->out.c_str());
    }
    engine.reset();
    shutdown();
    return 0;
  };
}

}  // namespace torchspeed::cli
