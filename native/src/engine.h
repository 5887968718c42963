// fluxlike-native: oneDNN's CPU engine, a prepared primitive (the primitive, the descriptions
// of its execution arguments and its scratchpad) and its execution.
//
// Every primitive is created with a user scratchpad: each execution allocates its own, so
// one prepared primitive may run from several threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"

namespace fluxlike_native {

// The one oneDNN CPU engine of the process.
inline dnnl::engine& engine() {
  static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

// A primitive attribute with the scratchpad left to the caller (see above).
dnnl::primitive_attr user_scratchpad();

// `bytes` of 64-byte-aligned memory (none for 0), freed on scope exit; `fn` and `what` name
// it when there is no memory for it.
struct Buffer {
  void* p = nullptr;
  Buffer(size_t bytes, const char* fn, const char* what = "oneDNN's scratchpad");
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

// A created primitive, ready to execute: what the primitive cache holds.
struct Prepared {
  dnnl::primitive prim;
  std::vector<std::pair<int, dnnl::memory::desc>> mds;  // DNNL_ARG_* -> its description
  dnnl::memory::desc scratch_md;
  size_t scratch_bytes = 0;
  // The temporary memory one execution allocates (its scratchpad; for a convolution also
  // the reordered weights): what a cached entry costs when it runs, counted by the cache.
  size_t work_bytes = 0;
  std::string impl;  // oneDNN's implementation name, e.g. "brg:avx512_core"
  // Created on one OpenMP thread (cpu.h: OneThread), so executed on one too: some
  // implementations fix their thread count when created (brgemm matmul), others take
  // OpenMP's at each execution (pooling, reorders), which would be the stream thread's.
  bool one_thread = false;
  // An AMX kernel (oneDNN's "...amx" implementations), whose tile loads run ~1.45x slower
  // from a source not on a cache line's boundary - as every MLX CPU buffer is (8 bytes past
  // 16; a 512 x 2048 x 2048 bfloat16 product 2.85 against 1.96 ms, Intel Xeon with AMX):
  // its callers give it an aligned copy of such a source.
  bool amx = false;

  const dnnl::memory::desc& md(int arg) const;
};

// The primitive of `pd` (created on one thread where OpenMP allows one now), with the descriptions of the arguments `args` (DNNL_ARG_*) it will
// be executed with.
Prepared prepare(const dnnl::primitive_desc_base& pd, std::initializer_list<int> args);

// (DNNL_ARG_*, buffer) pairs; a null buffer is left out (an optional bias).
using ExecArgs = std::initializer_list<std::pair<int, void*>>;

// This call's descriptions of the arguments that a primitive describes with runtime
// dimensions or strides (DNNL_RUNTIME_DIM_VAL: a matmul for any row count or shape), as
// (DNNL_ARG_*, description) pairs.
using ExecMds = std::vector<std::pair<int, dnnl::memory::desc>>;

// `md` with each runtime dimension given `size` (a plain layout whose strides are fixed).
dnnl::memory::desc sized(const dnnl::memory::desc& md, int64_t size);

// Runs `p` on `args` with a scratchpad of its own, on `strm`, and waits for it; `fn` names
// the op in an out-of-memory error. `actual` describes the arguments `p` has runtime
// dimensions or strides for (the others: `p`'s own descriptions).
void execute(const Prepared& p, dnnl::stream& strm, ExecArgs args, const char* fn,
             const ExecMds& actual = {});
void execute(const Prepared& p, ExecArgs args, const char* fn, const ExecMds& actual = {});

} // namespace fluxlike_native
