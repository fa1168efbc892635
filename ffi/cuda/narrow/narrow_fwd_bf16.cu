// The fwd kernels of the narrow MLP for bf16 (narrow_launch.h).
#include "cuda/narrow/narrow_launch.h"

namespace regemm::narrow {
REGEMM_NARROW_FWD(, __nv_bfloat16)
}  // namespace regemm::narrow
