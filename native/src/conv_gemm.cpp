// fluxlike-native: a convolution's backward passes as a GEMM without a primitive (see
// conv_gemm.h).

#include "conv_gemm.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "cpu.h"
#include "engine.h"
#include "oneapi/dnnl/dnnl.h"

namespace fluxlike_native {

namespace {

const char* FN = "fluxlike_native.conv";

// Visits each (row, kernel position) of the patch matrix in row-major order: f(row, column
// block, the x offset of its C entries or -1 where the window reads padding).
template <class F>
void patches(const mx::Shape& xs, const mx::Shape& ws, const mx::Shape& ys, const ConvParams& p,
             F&& f) {
  int k = static_cast<int>(xs.size()) - 2;
  int64_t per_image = 1, kernel = 1;
  for (int a = 0; a < k; ++a) {
    per_image *= ys[a + 1];
    kernel *= ws[a + 1];
  }
  // Each kernel position's offset along each axis (dilated), row-major.
  auto kpos = window_positions(std::vector<int64_t>(ws.begin() + 1, ws.end() - 1),
                               std::vector<int64_t>(p.dilation.begin(), p.dilation.end()));
  std::vector<int64_t> o(k, 0), origin(k);
  int64_t row = 0;
  for (int64_t n = 0; n < xs[0]; ++n) {
    for (int64_t i = 0; i < per_image; ++i, ++row) {
      for (int a = 0; a < k; ++a) origin[a] = o[a] * p.stride[a] - p.pad_lo[a];
      for (int64_t e = 0; e < kernel; ++e) {
        int64_t off = n;
        bool pad = false;
        for (int a = 0; a < k; ++a) {
          int64_t c = origin[a] + kpos[static_cast<size_t>(e * k + a)];
          pad = pad || c < 0 || c >= xs[a + 1];
          off = off * xs[a + 1] + c;
        }
        f(row, e, pad ? -1 : off * xs.back());
      }
      for (int a = k - 1; a >= 0 && ++o[a] == ys[a + 1]; --a) o[a] = 0;
    }
  }
}

void sgemm(char ta, char tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
           const float* b, int64_t ldb, float* c, int64_t ldc) {
  auto status = dnnl_sgemm(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
  if (status != dnnl_success) {
    throw std::runtime_error(std::string(FN) + ": oneDNN's GEMM failed (status " +
                             std::to_string(static_cast<int>(status)) + ")");
  }
}

} // namespace

void conv_backward_gemm(ConvKind kind, const float* in0, const float* in1, float* out,
                        const mx::Shape& xs, const mx::Shape& ws, const mx::Shape& ys,
                        const ConvParams& p) {
  if (p.groups != 1 || kind == ConvKind::Forward) {
    throw std::runtime_error(std::string(FN) + ": internal error: the GEMM path takes one "
                             "group's backward passes");
  }
  int64_t channels = xs.back(), outs = ws[0];
  int64_t rows = 1, cols = channels;
  for (size_t a = 0; a + 1 < ys.size(); ++a) rows *= ys[a];
  for (size_t a = 1; a + 1 < ws.size(); ++a) cols *= ws[a];
  OneThread one(static_cast<double>(rows) * static_cast<double>(cols) *
                    static_cast<double>(outs) < single_thread_macs());
  Float32Scratch patch(static_cast<size_t>(rows * cols), FN);  // (MLX's cache: common.h)
  auto* m = patch.get();
  size_t block = static_cast<size_t>(channels) * sizeof(float);
  if (kind == ConvKind::BackwardWeights) {  // dw (O x K) = dy^T (O x M) @ X (M x K)
    patches(xs, ws, ys, p, [&](int64_t row, int64_t e, int64_t at) {
      float* to = m + row * cols + e * channels;
      if (at < 0) {
        std::memset(to, 0, block);
      } else {
        std::memcpy(to, in0 + at, block);
      }
    });
    sgemm('T', 'N', outs, cols, rows, in1, outs, m, cols, out, cols);
    return;
  }
  // dX (M x K) = dy (M x O) @ W (O x K); dx = its rows added back where the patches came from.
  sgemm('N', 'N', rows, cols, outs, in0, outs, in1, cols, m, cols);
  size_t size = 1;
  for (auto d : xs) size *= static_cast<size_t>(d);
  std::fill(out, out + size, 0.0f);
  patches(xs, ws, ys, p, [&](int64_t row, int64_t e, int64_t at) {
    if (at >= 0) {
      const float* from = m + row * cols + e * channels;
      float* to = out + at;
      for (int64_t c = 0; c < channels; ++c) to[c] += from[c];
    }
  });
}

} // namespace fluxlike_native
