// RAII for MPI handles used inside comm/ (internal: includes <mpi.h>, never installed).
#pragma once

#include <mpi.h>

#include <cstdint>

namespace torchspeed::comm::detail {

// A committed contiguous datatype of `block` elements of `base`. Freeing it while an operation
// still uses it is allowed by MPI: the operation completes normally.
class MpiType {
 public:
  MpiType() = default;
  MpiType(const MpiType&) = delete;
  MpiType& operator=(const MpiType&) = delete;
  ~MpiType() { reset(); }
  void reset(int64_t block, MPI_Datatype base) {
    reset();
    MPI_Type_contiguous(static_cast<int>(block), base, &type_);
    MPI_Type_commit(&type_);
  }
  void reset() {
    if (type_ != MPI_DATATYPE_NULL) MPI_Type_free(&type_);
  }
  MPI_Datatype get() const { return type_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

}  // namespace torchspeed::comm::detail
