// What a kernel is asked to compute, free of any runtime state (streams,
// handles, scratch): shared by the CPU and CUDA kernels and by the registry
// that chooses between them.
#pragma once

#include <cstdint>
#include <string_view>

#include "activation.h"

namespace regemm {

enum class DType : int { kF32, kF64, kBF16, kF16 };
// Names as NumPy spells them (what Python passes to the module's functions).
inline constexpr std::string_view kDTypeNames[] = {"float32", "float64", "bfloat16", "float16"};

// Bytes per element.
inline int64_t dtype_size(DType t) { return t == DType::kF64 ? 8 : t == DType::kF32 ? 4 : 2; }

inline bool parse_dtype(std::string_view name, DType* t) {
  for (int i = 0; i < 4; ++i)
    if (kDTypeNames[i] == name) { *t = DType(i); return true; }
  return false;
}

// Where the bias broadcasts from (docs/spec.md §2). The names are the Python API's.
enum class BiasKind : int { kNone, kScalar, kPerRow, kPerCol };
inline constexpr std::string_view kBiasKindNames[] = {"none", "scalar", "per_row", "per_col"};

inline bool parse_bias_kind(std::string_view name, BiasKind* kind) {
  for (int i = 0; i < 4; ++i)
    if (kBiasKindNames[i] == name) { *kind = BiasKind(i); return true; }
  return false;
}

// Length of the bias vector of each kind for an M x N output.
inline int64_t bias_length(BiasKind kind, int64_t m, int64_t n) {
  switch (kind) {
    case BiasKind::kNone: return 0;
    case BiasKind::kScalar: return 1;
    case BiasKind::kPerRow: return m;
    case BiasKind::kPerCol: return n;
  }
  return 0;
}

// Index into the bias vector of element (i, j).
REGEMM_HD int64_t bias_index(BiasKind kind, int64_t i, int64_t j) {
  return kind == BiasKind::kPerRow ? i : kind == BiasKind::kPerCol ? j : 0;
}

// The fused forward: Z = alpha * op(A) @ op(B) + beta * C + bias, Y = act(Z).
// A plain GEMM is the same problem with act none, no bias and no C.
// A batch of `batch` problems: operand x of problem b starts at x + b * stride_x
// (stride 0: shared by the whole batch, never copied); Y and Z are dense.
struct GemmProblem {
  DType dtype = DType::kF32;
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false;  // A stored [K, M]
  bool trans_b = false;  // B stored [N, K]
  Act act = Act::kNone;
  double slope = 0.01;
  BiasKind bias_kind = BiasKind::kNone;
  double alpha = 1.0, beta = 0.0;
  bool has_c = false;
  bool store_z = false;
  bool exact_f32 = false;  // precision=HIGHEST: no TF32 for f32 inputs
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_bias = 0, stride_c = 0;

  int64_t lda() const { return trans_a ? m : k; }
  int64_t ldb() const { return trans_b ? k : n; }
  bool is_plain_gemm() const {
    return act == Act::kNone && bias_kind == BiasKind::kNone && !has_c && !store_z;
  }
  // Whether beta * C is computed: C given and beta nonzero (beta 0 never
  // reads C, as in BLAS).
  bool uses_c() const { return has_c && beta != 0.0; }
};

struct GemmOperands {
  const void* a;
  const void* b;
  const void* bias;  // null when bias_kind is none
  const void* c;     // null when !has_c
  void* y;
  void* z;           // null when !store_z
};

// The backward epilogue: gZ = gY * act'(S), S being Z (from_y false) or Y,
// and gBias = gZ summed over the bias kind's broadcast axes, per problem.
struct DactProblem {
  DType dtype = DType::kF32;
  int64_t m = 0, n = 0;
  Act act = Act::kNone;
  double slope = 0.01;
  bool from_y = false;
  BiasKind bias_kind = BiasKind::kNone;
  int64_t batch = 1;
  int64_t stride_gy = 0, stride_s = 0;  // gz and gbias are dense
};

struct DactOperands {
  const void* gy;
  const void* s;
  void* gz;
  void* gbias;  // null when bias_kind is none
};

// A layer's dgrad GEMM with the backward epilogue of the layer below it
// (jax_regemm.mlp's backward): `gemm` is the plain GEMM (no act, bias or C)
// whose output is gY of `dact` (gZ dense, S with dact.stride_s).
struct DgradDactProblem {
  GemmProblem gemm;
  DactProblem dact;
};

struct DgradDactOperands {
  const void* a;
  const void* b;
  const void* s;
  void* gz;
  void* gbias;  // null when dact.bias_kind is none
};

}  // namespace regemm
