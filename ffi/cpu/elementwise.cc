// Picks the elementwise epilogues compiled for the widest instruction set this
// CPU runs (CMake defines REGEMM_X86_ISAS where it built the x86-64-v3 and v4
// copies).
#include "elementwise.h"

namespace regemm {

namespace generic { extern const ElementwiseKernels kElementwise; }
#if defined(REGEMM_X86_ISAS)
namespace x86_64_v3 { extern const ElementwiseKernels kElementwise; }
namespace x86_64_v4 { extern const ElementwiseKernels kElementwise; }
#endif

const ElementwiseKernels& elementwise() {
  static const ElementwiseKernels& k = [&]() -> const ElementwiseKernels& {
#if defined(REGEMM_X86_ISAS)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return x86_64_v4::kElementwise;
    if (__builtin_cpu_supports("x86-64-v3")) return x86_64_v3::kElementwise;
#endif
    return generic::kElementwise;
  }();
  return k;
}

}  // namespace regemm
