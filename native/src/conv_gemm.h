// fluxlike-native: a float32 convolution's backward passes as oneDNN's GEMM over the input's
// patches, without a primitive (what a shape's first uses run while its primitive is made).
#pragma once

#include "conv.h"

namespace fluxlike_native {

// One group; shapes as the Conv primitive's: x (N, *S, C), w (O, *K, C), dy (N, *Out, O).
// BackwardData: in0 = dy, in1 = w, out = dx (N, *S, C). BackwardWeights: in0 = x, in1 = dy,
// out = dw (O, *K, C). Row-major float32 buffers. With the patches of x as the rows of an
// (N * prod(Out)) x (prod(K) * C) matrix X (zero where a window reads padding):
//   dw = dy^T X (one GEMM), dx = the patches of dy W added back where they came from
//   (col2im: each row's entries in row order).
// The same sums as oneDNN's primitives in another order (float32 rounding apart); a cotangent
// that is not finite meets the zero padding as MLX's explicit GEMM does (0 * inf = NaN).
// Up to single_thread_macs() on one OpenMP thread, as the primitives (cpu.h).
void conv_backward_gemm(ConvKind kind, const float* in0, const float* in1, float* out,
                        const mx::Shape& xs, const mx::Shape& ws, const mx::Shape& ys,
                        const ConvParams& p);

} // namespace fluxlike_native
