// The one wiring file: a DeepSpeed config (config/, validated when loaded) becomes the typed
// options of the training components, so that the components themselves (zero/, offload/, optim/,
// precision/) never include config/. The precision and the loss scaler (bf16, fp16 sections), the
// optimizer (optimizer section, parameter groups), ZeRO (zero_optimization, data_types,
// communication_data_type, gradient pre-division) and the offload stores (offload_optimizer,
// offload_param, aio). These only map the config; its checks ran when it was read.
#pragma once

#include <vector>

#include "torchspeed/config/config.h"
#include "torchspeed/offload/aio.h"
#include "torchspeed/precision/loss_scaler.h"
#include "torchspeed/zero/named_params.h"
#include "torchspeed/zero/partition_store.h"
#include "torchspeed/zero/zero_optimizer.h"

namespace torchspeed::wiring {

precision::Precision precision_of(const config::Config& c);
precision::LossScaler loss_scaler_of(const config::Config& c);  // LossScaler::none() without fp16
zero::OptimizerSpec optimizer_spec_of(const config::Config& c, const std::vector<zero::ParamGroup>& groups);
// Everything but norm_group, which depends on the process grid the engine runs in.
zero::ZeroOptions zero_options_of(const config::Config& c);

// offload::AioOptions from the config's "aio" section.
offload::AioOptions aio_options_of(const config::Config& c);
// The optimizer state store the config asks for: an OptimizerSwapper for offload_optimizer.device
// "nvme" (a file per rank under nvme_path), else null (RAM).
zero::PartitionStorePtr make_optimizer_store(const config::Config& c, int global_rank);
// The parameter store the config asks for: a ParamSwapper for offload_param.device "nvme" (a file
// per rank under nvme_path; `element_size` is the bytes of one parameter element), else null.
zero::ShardStorePtr make_param_store(const config::Config& c, int global_rank, int64_t element_size);

}  // namespace torchspeed::wiring
