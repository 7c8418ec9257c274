// The PartitionOptimizer implementations beyond the elementwise ones, for
// make_partition_optimizer. Internal to optim/.
#pragma once

#include <memory>

#include "torchspeed/optim/partition_optimizer.h"

namespace torchspeed::optim::detail {

std::unique_ptr<PartitionOptimizer> make_lamb(OptimizerSpec spec, comm::CommunicatorPtr dp);         // lamb_optimizers.cpp
std::unique_ptr<PartitionOptimizer> make_onebit_lamb(OptimizerSpec spec, comm::CommunicatorPtr dp);  // lamb_optimizers.cpp
std::unique_ptr<PartitionOptimizer> make_onebit_adam(OptimizerSpec spec, comm::CommunicatorPtr dp);  // onebit_optimizers.cpp
std::unique_ptr<PartitionOptimizer> make_zero_one_adam(OptimizerSpec spec, comm::CommunicatorPtr dp);  // onebit_optimizers.cpp

}  // namespace torchspeed::optim::detail
