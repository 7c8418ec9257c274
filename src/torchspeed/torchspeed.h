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
#include "torchspeed/runtime/cpu.h"
#include "torchspeed/runtime/error.h"
#include "torchspeed/runtime/launcher.h"
#include "torchspeed/runtime/logging.h"
#include "torchspeed/comm/runtime.h"
