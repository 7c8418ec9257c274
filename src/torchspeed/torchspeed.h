// torchspeed: DeepSpeed's capabilities, natively in C++, for LibTorch. The umbrella header.
#pragma once

#include "torchspeed/comm/communicator.h"
#include "torchspeed/config/config.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/engine/trainer.h"
#include "torchspeed/nn/layer_stack.h"
#include "torchspeed/optim/lr_schedule.h"
#include "torchspeed/precision/loss_scaler.h"
#include "torchspeed/parallel/process_grid.h"
#include "torchspeed/base/cpu.h"
#include "torchspeed/base/error.h"
#include "torchspeed/launch/launcher.h"
#include "torchspeed/base/logging.h"
#include "torchspeed/comm/runtime.h"
