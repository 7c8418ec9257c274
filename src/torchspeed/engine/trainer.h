// Trainer: the training loop around an Engine, as a library (what `torchspeed train` runs):
// optimizer steps up to train.steps, validation and checkpoint cadence, exact resume from the
// latest checkpoint (the data's position included), and the agreement of every rank to stop
// after a step when one of them is asked to (a signal, or a stop file). After each step it
// sends one StepReport to its StepObservers (monitor/observers.h): the CSV, the progress line
// and anything a caller adds.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "torchspeed/engine/engine.h"
#include "torchspeed/monitor/observers.h"

namespace torchspeed {

struct TrainerOptions {
  int64_t steps = 1;              // the last optimizer step (train.steps)
  int64_t eval_interval = 0;      // validate after every this many steps (0: only after the last)
  int64_t log_interval = 1;       // the window over which tokens/s is measured
  int64_t checkpoint_interval = 0;  // save every this many steps before the last (0: never)
  std::string checkpoint_dir;     // where save() writes and resume() reads
  int64_t tokens_per_step = 0;    // for tokens/s (0: not reported)
  double flops_per_token = 0.0, peak_flops = 0.0;  // for MFU against the machine's peak (0: not reported)
  // A file whose existence, seen by world rank 0 after a step, stops every rank ("" : none).
  std::string stop_file;
  // This rank's own request to stop (a signal handler's flag); null: none.
  std::function<bool()> stop_requested;
};

// What the loop trains and validates on.
struct TrainData {
  std::function<double(Engine&)> train_step;  // one optimizer step over the next batch: its mean loss
  std::function<double(Engine&)> evaluate;    // the validation loss, the same on every rank
  std::function<nlohmann::json()> state;      // the data's position, saved with each checkpoint
  std::function<void(const nlohmann::json&)> load_state;

  // A loader with next() / state() / load_state() (data::TextLoader): train_batch over it, and
  // validation over `eval_batches` batches of a fresh loader from make_val().
  template <typename Loader, typename MakeVal>
  static TrainData of(Loader& train, MakeVal make_val, int64_t eval_batches) {
    TrainData d;
    d.train_step = [&train](Engine& e) { return e.train_batch(train); };
    d.evaluate = [make_val, eval_batches](Engine& e) {
      auto val = make_val();
      double sum = 0.0;
      for (int64_t i = 0; i < eval_batches; ++i) sum += e.eval_batch(val);
      return sum / static_cast<double>(eval_batches);
    };
    d.state = [&train] { return train.state(); };
    d.load_state = [&train](const nlohmann::json& s) { train.load_state(s); };
    return d;
  }
};

struct TrainResult {
  int64_t step = 0;              // the last step taken
  bool interrupted = false;      // a stop was agreed before options.steps
  bool autotuning_done = false;  // an autotuning experiment ended (the engine wrote its metrics)
  // The last validation loss measured: the last step's unless the run was interrupted or an
  // autotuning experiment (then the latest evaluated step's, if any).
  std::optional<double> val_loss;
};

class Trainer {
 public:
  Trainer(Engine& engine, TrainData data, TrainerOptions options);

  void add_observer(monitor::StepObserverPtr observer) { observers_.push_back(std::move(observer)); }
  // Loads checkpoint_dir's latest checkpoint and the data's position; nullopt (and step 0) when
  // there is none yet. Collective.
  std::optional<Engine::LoadedCheckpoint> resume();
  // Saves a checkpoint of the current step with the data's position; its path. Collective.
  std::string save();
  // Steps from step() + 1 to options.steps, or until every rank agreed to stop or an autotuning
  // experiment ended. Collective.
  TrainResult run();
  int64_t step() const { return step_; }

 private:
  Engine& engine_;
  TrainData data_;
  TrainerOptions opt_;
  std::vector<monitor::StepObserverPtr> observers_;
  int64_t step_ = 0;
};

}  // namespace torchspeed
