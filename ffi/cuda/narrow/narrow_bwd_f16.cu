// The bwd kernels of the narrow MLP for f16 (narrow_launch.h).
#include "cuda/narrow/narrow_launch.h"

namespace regemm::narrow {
REGEMM_NARROW_BWD(, __half)
}  // namespace regemm::narrow
