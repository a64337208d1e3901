// XLA FFI handler that launches Triton-compiled kernels (cubins) on XLA's CUDA stream.
//
// transformer_engine.jax.primitives.gpu compiles the project's Triton kernels with
// triton.compile, exactly as Triton's own JIT would specialize them, and lowers each fused
// attention primitive to one custom call "te_triton_launch" whose attributes carry
//
//   blob:    uint8[]  the cubins and kernel names, concatenated;
//   program: int64[]  what to do, in order (layout below; version kProgramVersion).
//
// The handler reads the program on every call: zero-fill (or +inf-fill) some buffers, then
// launch kernels with their arguments in Triton's launch ABI order: the kernel's non-constexpr
// parameters, then the global and profile scratch pointers Triton 3.6 appends. Modules are
// loaded once per (kernel hash, CUDA context) and kept for the process.
//
// program layout (all int64):
//   [0] kProgramVersion
//   [1] number of kernels K, then K records:
//       hash, blob offset of cubin, cubin size, blob offset of name, name size, shared bytes, num_warps
//   then number of fills F, then F records: buffer index, 32-bit fill value, fill width (1 or 4 bytes)
//   then number of launches L, then L records:
//       kernel index, grid x, grid y, grid z, number of params P, then P (kind, value) pairs
// Buffer indices count the call's operands first, then its results.

#include <cuda.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kProgramVersion = 1;

enum ParamKind : int64_t {
  kBuffer = 0,   // device pointer of buffer `value`
  kInt32 = 1,    // 32-bit integer `value`
  kInt64 = 2,    // 64-bit integer `value`
  kFloat32 = 3,  // 32-bit float whose bit pattern is `value`
  kNull = 4,     // null pointer (Triton's scratch pointers when the kernel needs none)
};

struct KernelRecord {
  uint64_t hash;
  int64_t cubin_offset, cubin_size, name_offset, name_size, shared, num_warps;
};

ffi::Error CuError(CUresult result, const std::string& what) {
  const char* text = nullptr;
  cuGetErrorString(result, &text);
  return ffi::Error(ffi::ErrorCode::kInternal,
                    "te_triton_launch: " + what + ": " + (text ? text : "unknown CUDA error"));
}

#define TE_CU_CHECK(expr, what)                  \
  do {                                           \
    CUresult _result = (expr);                   \
    if (_result != CUDA_SUCCESS) {               \
      return CuError(_result, what);             \
    }                                            \
  } while (0)

ffi::Error BadProgram(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "te_triton_launch: malformed program: " + what);
}

// Kernels loaded so far, by (kernel hash, context). Modules stay loaded for the process.
std::mutex g_mutex;
std::map<std::pair<uint64_t, CUcontext>, CUfunction> g_functions;

ffi::Error LoadFunction(const KernelRecord& k, ffi::Span<const uint8_t> blob, CUcontext context,
                        CUfunction* function) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto found = g_functions.find({k.hash, context});
  if (found != g_functions.end()) {
    *function = found->second;
    return ffi::Error::Success();
  }
  if (k.cubin_offset < 0 || k.name_offset < 0 || k.cubin_offset + k.cubin_size > (int64_t)blob.size() ||
      k.name_offset + k.name_size > (int64_t)blob.size()) {
    return BadProgram("kernel record points outside the blob");
  }
  std::vector<uint8_t> cubin(blob.begin() + k.cubin_offset, blob.begin() + k.cubin_offset + k.cubin_size);
  std::string name(reinterpret_cast<const char*>(blob.begin() + k.name_offset), k.name_size);
  CUmodule module;
  TE_CU_CHECK(cuModuleLoadData(&module, cubin.data()), "cuModuleLoadData(" + name + ")");
  CUfunction fn;
  TE_CU_CHECK(cuModuleGetFunction(&fn, module, name.c_str()), "cuModuleGetFunction(" + name + ")");
  // As Triton's loader: kernels using more than 48 KiB of shared memory must opt in.
  CUdevice device;
  TE_CU_CHECK(cuCtxGetDevice(&device), "cuCtxGetDevice");
  int shared_optin = 0;
  TE_CU_CHECK(cuDeviceGetAttribute(&shared_optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device),
              "cuDeviceGetAttribute");
  if (k.shared > 49152 && shared_optin > 49152) {
    TE_CU_CHECK(cuFuncSetCacheConfig(fn, CU_FUNC_CACHE_PREFER_SHARED), "cuFuncSetCacheConfig");
    int shared_static = 0;
    TE_CU_CHECK(cuFuncGetAttribute(&shared_static, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn), "cuFuncGetAttribute");
    TE_CU_CHECK(cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_optin - shared_static),
                "cuFuncSetAttribute");
  }
  g_functions[{k.hash, context}] = fn;
  *function = fn;
  return ffi::Error::Success();
}

// Makes the stream's context current for the scope (XLA's thread normally has it already).
class ScopedContext {
 public:
  explicit ScopedContext(CUcontext context) {
    CUcontext current = nullptr;
    cuCtxGetCurrent(&current);
    if (current != context) {
      pushed_ = cuCtxPushCurrent(context) == CUDA_SUCCESS;
    }
  }
  ~ScopedContext() {
    if (pushed_) {
      CUcontext popped;
      cuCtxPopCurrent(&popped);
    }
  }

 private:
  bool pushed_ = false;
};

class ProgramReader {
 public:
  explicit ProgramReader(ffi::Span<const int64_t> program) : program_(program) {}
  bool Next(int64_t* value) {
    if (pos_ >= program_.size()) return false;
    *value = program_[pos_++];
    return true;
  }

 private:
  ffi::Span<const int64_t> program_;
  size_t pos_ = 0;
};

ffi::Error TritonLaunchImpl(CUstream stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                            ffi::Span<const int64_t> program, ffi::Span<const uint8_t> blob) {
  // Device pointers and sizes of every operand, then every result.
  std::vector<CUdeviceptr> pointers;
  std::vector<size_t> sizes;
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    pointers.push_back(reinterpret_cast<CUdeviceptr>(buffer->untyped_data()));
    sizes.push_back(buffer->size_bytes());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buffer = rets.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    pointers.push_back(reinterpret_cast<CUdeviceptr>((*buffer)->untyped_data()));
    sizes.push_back((*buffer)->size_bytes());
  }

  CUcontext context;
  TE_CU_CHECK(cuStreamGetCtx(stream, &context), "cuStreamGetCtx");
  ScopedContext scoped(context);

  ProgramReader reader(program);
  int64_t version, n_kernels;
  if (!reader.Next(&version) || version != kProgramVersion) {
    return BadProgram("version " + std::to_string(version) + ", expected " + std::to_string(kProgramVersion));
  }
  if (!reader.Next(&n_kernels) || n_kernels < 0) return BadProgram("kernel count");
  std::vector<KernelRecord> kernels(n_kernels);
  for (auto& k : kernels) {
    int64_t hash;
    if (!(reader.Next(&hash) && reader.Next(&k.cubin_offset) && reader.Next(&k.cubin_size) &&
          reader.Next(&k.name_offset) && reader.Next(&k.name_size) && reader.Next(&k.shared) &&
          reader.Next(&k.num_warps))) {
      return BadProgram("kernel record");
    }
    k.hash = static_cast<uint64_t>(hash);
  }

  int64_t n_fills;
  if (!reader.Next(&n_fills) || n_fills < 0) return BadProgram("fill count");
  for (int64_t i = 0; i < n_fills; ++i) {
    int64_t index, value, width;
    if (!(reader.Next(&index) && reader.Next(&value) && reader.Next(&width))) return BadProgram("fill record");
    if (index < 0 || index >= (int64_t)pointers.size()) return BadProgram("fill buffer index");
    if (width == 1) {
      TE_CU_CHECK(cuMemsetD8Async(pointers[index], static_cast<unsigned char>(value), sizes[index], stream),
                  "cuMemsetD8Async");
    } else if (width == 4 && sizes[index] % 4 == 0) {
      TE_CU_CHECK(cuMemsetD32Async(pointers[index], static_cast<unsigned int>(value), sizes[index] / 4, stream),
                  "cuMemsetD32Async");
    } else {
      return BadProgram("fill width");
    }
  }

  int64_t n_launches;
  if (!reader.Next(&n_launches) || n_launches < 0) return BadProgram("launch count");
  for (int64_t l = 0; l < n_launches; ++l) {
    int64_t kernel_index, gx, gy, gz, n_params;
    if (!(reader.Next(&kernel_index) && reader.Next(&gx) && reader.Next(&gy) && reader.Next(&gz) &&
          reader.Next(&n_params))) {
      return BadProgram("launch record");
    }
    if (kernel_index < 0 || kernel_index >= n_kernels || n_params < 0) return BadProgram("launch kernel index");
    // One 8-byte slot per parameter; the driver reads each parameter's own size from its slot.
    std::vector<uint64_t> storage(n_params, 0);
    std::vector<void*> params(n_params);
    for (int64_t p = 0; p < n_params; ++p) {
      int64_t kind, value;
      if (!(reader.Next(&kind) && reader.Next(&value))) return BadProgram("launch parameter");
      switch (kind) {
        case kBuffer:
          if (value < 0 || value >= (int64_t)pointers.size()) return BadProgram("parameter buffer index");
          // Kernels are compiled assuming 16-byte aligned pointers (Triton's default specialization).
          if (pointers[value] % 16 != 0) {
            return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                              "te_triton_launch: buffer " + std::to_string(value) + " is not 16-byte aligned");
          }
          storage[p] = static_cast<uint64_t>(pointers[value]);
          break;
        case kInt32: {
          int32_t v = static_cast<int32_t>(value);
          std::memcpy(&storage[p], &v, sizeof(v));
          break;
        }
        case kInt64:
          std::memcpy(&storage[p], &value, sizeof(value));
          break;
        case kFloat32: {
          uint32_t bits = static_cast<uint32_t>(value);
          std::memcpy(&storage[p], &bits, sizeof(bits));
          break;
        }
        case kNull:
          storage[p] = 0;
          break;
        default:
          return BadProgram("parameter kind " + std::to_string(kind));
      }
      params[p] = &storage[p];
    }
    if (gx * gy * gz == 0) continue;  // as Triton's launcher: an empty grid launches nothing
    const KernelRecord& k = kernels[kernel_index];
    CUfunction fn;
    ffi::Error loaded = LoadFunction(k, blob, context, &fn);
    if (loaded.failure()) return loaded;
    TE_CU_CHECK(cuLaunchKernel(fn, static_cast<unsigned>(gx), static_cast<unsigned>(gy), static_cast<unsigned>(gz),
                               static_cast<unsigned>(32 * k.num_warps), 1, 1, static_cast<unsigned>(k.shared), stream,
                               params.data(), nullptr),
                "cuLaunchKernel");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeTritonLaunch, TritonLaunchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("program")
                                  .Attr<ffi::Span<const uint8_t>>("blob"));

PYBIND11_MODULE(transformer_engine_jax_ffi, m) {
  m.doc() = "XLA FFI launcher of Triton-compiled kernels for transformer_engine.jax";
  m.attr("PROGRAM_VERSION") = kProgramVersion;
  m.def("registrations", []() {
    pybind11::dict targets;
    targets["te_triton_launch"] = pybind11::capsule(reinterpret_cast<void*>(TeTritonLaunch));
    return targets;
  }, "FFI target name -> handler capsule, for jax.ffi.register_ffi_target(..., platform='CUDA').");
}
