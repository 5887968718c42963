// fluxlike-native: prepared oneDNN primitives and their execution (see engine.h).

#include "engine.h"

#include "cpu.h"

#include <cstdlib>
#include <stdexcept>
#include <unordered_map>

namespace fluxlike_native {

dnnl::primitive_attr user_scratchpad() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

Buffer::Buffer(size_t bytes, const char* fn, const char* what) {
  if (bytes > 0) {
    p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (p == nullptr) {
      throw std::runtime_error(std::string(fn) + ": out of memory for " + what);
    }
  }
}

Buffer::~Buffer() {
  std::free(p);
}

const dnnl::memory::desc& Prepared::md(int arg) const {
  for (const auto& [id, md] : mds) {
    if (id == arg) {
      return md;
    }
  }
  throw std::logic_error("fluxlike_native: internal error: no description of argument " +
                         std::to_string(arg) + " for " + impl);
}

Prepared prepare(const dnnl::primitive_desc_base& pd, std::initializer_list<int> args) {
  Prepared p;
  for (int arg : args) {
    p.mds.emplace_back(arg, pd.query_md(dnnl::query::exec_arg_md, arg));
  }
  p.scratch_md = pd.scratchpad_desc();
  p.scratch_bytes = p.scratch_md.get_size();
  p.work_bytes = p.scratch_bytes;
  p.impl = pd.impl_info_str();
  p.amx = p.impl.find("amx") != std::string::npos;
  p.one_thread = omp_max_threads() == 1;
  p.prim = dnnl::primitive(pd.get());
  return p;
}

dnnl::memory::desc sized(const dnnl::memory::desc& md, int64_t size) {
  auto dims = md.get_dims();
  for (auto& d : dims) {
    if (d == DNNL_RUNTIME_DIM_VAL) {
      d = size;
    }
  }
  return dnnl::memory::desc(dims, md.get_data_type(), md.get_strides());
}

void execute(const Prepared& p, dnnl::stream& strm, ExecArgs args, const char* fn,
             const ExecMds& actual) {
  auto& eng = engine();
  std::unordered_map<int, dnnl::memory> mem;
  auto md = [&](int arg) -> const dnnl::memory::desc& {
    for (const auto& [id, given] : actual) {
      if (id == arg) {
        return given;
      }
    }
    return p.md(arg);
  };
  for (const auto& [arg, ptr] : args) {
    if (ptr != nullptr) {
      mem.emplace(arg, dnnl::memory(md(arg), eng, ptr));
    }
  }
  Buffer scratch(p.scratch_bytes, fn);
  if (scratch.p) {
    mem.emplace(DNNL_ARG_SCRATCHPAD, dnnl::memory(p.scratch_md, eng, scratch.p));
  }
  OneThread one(p.one_thread);
  p.prim.execute(strm, mem);
  strm.wait();
}

void execute(const Prepared& p, ExecArgs args, const char* fn, const ExecMds& actual) {
  dnnl::stream strm(engine());
  execute(p, strm, args, fn, actual);
}

} // namespace fluxlike_native
