// A PJRT host of libxla_ssm's XLA FFI targets, with no JAX and no XLA headers: it loads a PJRT
// plugin (argv[1]; on a GPU machine the CUDA plugin of the `jax-cuda13-pjrt` wheel), registers
// the library's handlers (argv[2], libxla_ssm.so) through the plugin's FFI extension, compiles
// StableHLO modules that call `xla_ssm_selective_scan_fwd` and `xla_ssm_ssd_fwd` the way the JAX
// binding does (bindings/python/xla_ssm/_scan.py, _ssd.py: operands, attributes, results, and the
// workspace result on CUDA), runs them on device buffers, and checks every result against the
// library's host C API (`*_host`, the CPU implementation) and a naive double-precision loop
// written here from docs/selective_scan_fwd.md and docs/ssd.md.
//
// Each module is compiled in two forms: "typed-ffi" (`api_version = 4`, the attributes as the
// `backend_config` dictionary: StableHLO's typed-FFI custom call) and "jax" (what
// `jax.ffi.ffi_call` emits: `api_version = 1`, `backend_config = ""` and the dictionary in
// `mhlo.backend_config`, which XLA turns into a typed-FFI call).
//
// Prints PASS / FAIL per check and exits 1 on any failure or PJRT error (with its message), 2 on
// bad usage; XLA_SSM_PJRT_PRINT_MLIR=1 also prints each module. tests/cpp/run.sh finds the plugin,
// builds this file and runs it.
//
// Build: g++ -std=c++17 -O1 -Wall -Wextra -Werror -I include tests/cpp/pjrt_ffi_host.cc -ldl
#include <dlfcn.h>

#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pjrt_c_api_min.h"
#include "xla_ssm.h"

namespace {

int g_failures = 0;

std::string Format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string Format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char buf[1024];
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

// A PJRT call that failed: the function's name, the error's code and message.
struct PjrtFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Runs the cleanups it is given in reverse order when it goes out of scope (also on a throw).
class Cleanup {
 public:
  Cleanup() = default;
  Cleanup(const Cleanup&) = delete;
  Cleanup& operator=(const Cleanup&) = delete;
  ~Cleanup() {
    for (auto it = fns_.rbegin(); it != fns_.rend(); ++it) (*it)();
  }
  void Add(std::function<void()> fn) { fns_.push_back(std::move(fn)); }

 private:
  std::vector<std::function<void()>> fns_;
};

// ------------------------------------------------------------------------------- the plugin

class Pjrt {
 public:
  explicit Pjrt(const PJRT_Api* api) : api_(api) {}
  const PJRT_Api* api() const { return api_; }

  // Throws PjrtFailure naming `what` with the error's code and message (and frees the error).
  void Check(PJRT_Error* err, const char* what) const {
    if (err == nullptr) return;
    PJRT_Error_Message_Args m;
    std::memset(&m, 0, sizeof m);
    m.struct_size = PJRT_Error_Message_Args_STRUCT_SIZE;
    m.error = err;
    api_->PJRT_Error_Message(&m);
    std::string message(m.message ? m.message : "", m.message ? m.message_size : 0);
    PJRT_Error_GetCode_Args c;
    std::memset(&c, 0, sizeof c);
    c.struct_size = PJRT_Error_GetCode_Args_STRUCT_SIZE;
    c.error = err;
    PJRT_Error* code_err = api_->PJRT_Error_GetCode(&c);
    int code = code_err == nullptr ? static_cast<int>(c.code) : -1;
    Free(code_err);
    Free(err);
    throw PjrtFailure(Format("PJRT error in %s (code %d): ", what, code) + message);
  }

  void Free(PJRT_Error* err) const {
    if (err == nullptr) return;
    PJRT_Error_Destroy_Args d;
    std::memset(&d, 0, sizeof d);
    d.struct_size = PJRT_Error_Destroy_Args_STRUCT_SIZE;
    d.error = err;
    api_->PJRT_Error_Destroy(&d);
  }

  // Waits for `event` and frees it; throws with the event's error.
  void AwaitAndFree(PJRT_Event* event, const char* what) const {
    if (event == nullptr) return;
    PJRT_Event_Await_Args a;
    std::memset(&a, 0, sizeof a);
    a.struct_size = PJRT_Event_Await_Args_STRUCT_SIZE;
    a.event = event;
    PJRT_Error* err = api_->PJRT_Event_Await(&a);
    PJRT_Event_Destroy_Args d;
    std::memset(&d, 0, sizeof d);
    d.struct_size = PJRT_Event_Destroy_Args_STRUCT_SIZE;
    d.event = event;
    Free(api_->PJRT_Event_Destroy(&d));
    Check(err, what);
  }

  void DestroyBuffer(PJRT_Buffer* buffer) const {
    if (buffer == nullptr) return;
    PJRT_Buffer_Destroy_Args d;
    std::memset(&d, 0, sizeof d);
    d.struct_size = PJRT_Buffer_Destroy_Args_STRUCT_SIZE;
    d.buffer = buffer;
    Free(api_->PJRT_Buffer_Destroy(&d));
  }

  void DestroyLoaded(PJRT_LoadedExecutable* exe) const {
    if (exe == nullptr) return;
    PJRT_LoadedExecutable_Destroy_Args d;
    std::memset(&d, 0, sizeof d);
    d.struct_size = PJRT_LoadedExecutable_Destroy_Args_STRUCT_SIZE;
    d.executable = exe;
    Free(api_->PJRT_LoadedExecutable_Destroy(&d));
  }

 private:
  const PJRT_Api* api_;
};

// Checks the version and that the table reaches the last entry used here.
void CheckApiVersion(const PJRT_Api* api) {
  const int major = api->pjrt_api_version.major_version;
  const int minor = api->pjrt_api_version.minor_version;
  std::printf("plugin PJRT C API %d.%d (struct_size %zu); these declarations: %d.%d\n", major, minor,
              api->struct_size, PJRT_MIN_API_MAJOR, PJRT_MIN_API_MINOR);
  if (major != PJRT_MIN_API_MAJOR) {
    throw std::runtime_error(Format("PJRT major version %d, these declarations are for %d", major,
                                    PJRT_MIN_API_MAJOR));
  }
  if (minor < PJRT_MIN_API_MINOR) {
    throw std::runtime_error(Format("plugin's PJRT C API 0.%d is older than these declarations (0.%d)",
                                    minor, PJRT_MIN_API_MINOR));
  }
  if (minor > PJRT_MIN_API_MINOR) {
    std::printf("note: the plugin is newer (0.%d); minor versions only append, so 0.%d's layouts hold\n",
                minor, PJRT_MIN_API_MINOR);
  }
  const size_t needed = offsetof(PJRT_Api, PJRT_Buffer_ToHostBuffer) + sizeof(void*);
  if (api->struct_size < needed) {
    throw std::runtime_error(Format("PJRT_Api struct_size %zu < %zu", api->struct_size, needed));
  }
}

const PJRT_FFI_Extension* FindFfiExtension(const PJRT_Api* api) {
  for (const PJRT_Extension_Base* ext = api->extension_start; ext != nullptr; ext = ext->next) {
    if (ext->type == PJRT_Extension_Type_FFI) {
      if (ext->struct_size < PJRT_FFI_Extension_STRUCT_SIZE) {
        throw std::runtime_error(Format("PJRT FFI extension of %zu bytes, need %d", ext->struct_size,
                                        static_cast<int>(PJRT_FFI_Extension_STRUCT_SIZE)));
      }
      return reinterpret_cast<const PJRT_FFI_Extension*>(ext);
    }
  }
  throw std::runtime_error("the plugin has no PJRT FFI extension (type 5) in its extension chain");
}

void PrintPluginAttributes(const Pjrt& pjrt) {
  PJRT_Plugin_Attributes_Args a;
  std::memset(&a, 0, sizeof a);
  a.struct_size = PJRT_Plugin_Attributes_Args_STRUCT_SIZE;
  pjrt.Check(pjrt.api()->PJRT_Plugin_Attributes(&a), "PJRT_Plugin_Attributes");
  std::string line;
  for (size_t i = 0; i < a.num_attributes; ++i) {
    const PJRT_NamedValue& v = a.attributes[i];
    line += " " + std::string(v.name, v.name_size) + "=";
    switch (v.type) {
      case PJRT_NamedValue_kString:
        line += std::string(v.string_value, v.value_size);
        break;
      case PJRT_NamedValue_kInt64:
        line += std::to_string(v.int64_value);
        break;
      case PJRT_NamedValue_kInt64List:
        for (size_t j = 0; j < v.value_size; ++j) line += (j ? "." : "") + std::to_string(v.int64_array_value[j]);
        break;
      case PJRT_NamedValue_kFloat:
        line += Format("%g", static_cast<double>(v.float_value));
        break;
      case PJRT_NamedValue_kBool:
        line += v.bool_value ? "true" : "false";
        break;
    }
  }
  std::printf("plugin attributes:%s\n", line.c_str());
}

// ------------------------------------------------------------------------------ the library

struct SsmLib {
  void* handle = nullptr;
  decltype(&xla_ssm_version) version = nullptr;
  decltype(&xla_ssm_last_error) last_error = nullptr;
  decltype(&xla_ssm_selective_scan_fwd_host) scan_host = nullptr;
  decltype(&xla_ssm_selective_scan_fwd_workspace_bytes) scan_workspace_bytes = nullptr;
  decltype(&xla_ssm_ssd_fwd_host) ssd_host = nullptr;
  decltype(&xla_ssm_ssd_fwd_workspace_bytes) ssd_workspace_bytes = nullptr;
  decltype(&xla_ssm_ssd_chunk_states_dtype) ssd_chunk_states_dtype = nullptr;

  void* Sym(const char* name) const {
    void* p = dlsym(handle, name);
    if (p == nullptr) throw std::runtime_error(Format("libxla_ssm.so does not export %s", name));
    return p;
  }
  template <typename F>
  void Load(F& fn, const char* name) {
    fn = reinterpret_cast<F>(Sym(name));
  }
};

SsmLib OpenLibrary(const char* path) {
  SsmLib lib;
  lib.handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib.handle == nullptr) throw std::runtime_error(Format("dlopen(%s): %s", path, dlerror()));
  lib.Load(lib.version, "xla_ssm_version");
  lib.Load(lib.last_error, "xla_ssm_last_error");
  lib.Load(lib.scan_host, "xla_ssm_selective_scan_fwd_host");
  lib.Load(lib.scan_workspace_bytes, "xla_ssm_selective_scan_fwd_workspace_bytes");
  lib.Load(lib.ssd_host, "xla_ssm_ssd_fwd_host");
  lib.Load(lib.ssd_workspace_bytes, "xla_ssm_ssd_fwd_workspace_bytes");
  lib.Load(lib.ssd_chunk_states_dtype, "xla_ssm_ssd_chunk_states_dtype");
  return lib;
}

// -------------------------------------------------------------------- StableHLO generation

std::string Dims(const std::vector<int64_t>& dims, const char* sep) {
  std::string s;
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? sep : "") + std::to_string(dims[i]);
  return s;
}

std::string TensorType(const std::vector<int64_t>& dims, const char* elt) {
  return "tensor<" + Dims(dims, "x") + (dims.empty() ? "" : "x") + elt + ">";
}

// Row-major (minor-to-major = rank-1 .. 0), as JAX writes operand_layouts / result_layouts.
std::string RowMajorLayout(size_t rank) {
  std::string s = "dense<[";
  for (size_t i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(rank - 1 - i);
  return s + "]> : tensor<" + std::to_string(rank) + "xindex>";
}

// One custom-call attribute, already in MLIR syntax.
struct Attr {
  std::string name;
  std::string value;
};
Attr Bool(const char* name, bool v) { return {name, v ? "true" : "false"}; }  // i1 (PRED)
Attr I64(const char* name, int64_t v) { return {name, std::to_string(v) + " : i64"}; }
Attr Str(const char* name, const char* v) { return {name, std::string("\"") + v + "\""}; }
Attr F32(const char* name, float v) {  // the bit pattern: exact, and fine for +-inf
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return {name, Format("0x%08" PRIX32 " : f32", bits)};
}

enum class Form { kTypedFfi, kJax };
const char* FormName(Form f) { return f == Form::kTypedFfi ? "typed-ffi" : "jax"; }

struct Tensor {
  std::vector<int64_t> dims;
  std::vector<float> data;
};

int64_t NumElements(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

// A module whose main takes `operands` (f32), calls `target` once with `attrs`, and returns its
// f32 results; with workspace_bytes > 0 the call also has a last ui8[workspace_bytes] result,
// which main drops (jax's `_ffi` helper on CUDA).
std::string BuildModule(const std::string& target, const std::vector<Tensor>& operands,
                        const std::vector<std::vector<int64_t>>& results, int64_t workspace_bytes,
                        const std::vector<Attr>& attrs, Form form) {
  std::vector<std::string> in_types, out_types, args;
  std::string in_layouts, out_layouts;
  for (size_t i = 0; i < operands.size(); ++i) {
    in_types.push_back(TensorType(operands[i].dims, "f32"));
    args.push_back("%arg" + std::to_string(i));
    in_layouts += (i ? ", " : "") + RowMajorLayout(operands[i].dims.size());
  }
  for (size_t i = 0; i < results.size(); ++i) {
    out_types.push_back(TensorType(results[i], "f32"));
    out_layouts += (i ? ", " : "") + RowMajorLayout(results[i].size());
  }
  std::vector<std::string> call_types = out_types;
  if (workspace_bytes > 0) {
    call_types.push_back(TensorType({workspace_bytes}, "ui8"));
    out_layouts += ", " + RowMajorLayout(1);
  }
  auto join = [](const std::vector<std::string>& v, const std::string& prefix) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + prefix + v[i];
    return s;
  };
  std::string dict = "{";
  for (size_t i = 0; i < attrs.size(); ++i) dict += (i ? ", " : "") + attrs[i].name + " = " + attrs[i].value;
  dict += "}";
  std::string config = form == Form::kTypedFfi
                           ? "api_version = 4 : i32, backend_config = " + dict
                           : "api_version = 1 : i32, backend_config = \"\", mhlo.backend_config = " + dict;
  std::string params;
  for (size_t i = 0; i < operands.size(); ++i) params += (i ? ", " : "") + args[i] + ": " + in_types[i];
  std::string rets;
  for (size_t i = 0; i < results.size(); ++i) rets += (i ? ", " : "") + Format("%%0#%zu", i);

  std::string m;
  m += "module @xla_ssm_pjrt_ffi_host attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {\n";
  m += "  func.func public @main(" + params + ") -> (" + join(out_types, "") + ") {\n";
  m += "    %0:" + std::to_string(call_types.size()) + " = stablehlo.custom_call @" + target + "(" +
       join(args, "") + ") {" + config + ", operand_layouts = [" + in_layouts + "], result_layouts = [" +
       out_layouts + "]} : (" + join(in_types, "") + ") -> (" + join(call_types, "") + ")\n";
  m += "    return " + rets + " : " + join(out_types, "") + "\n";
  m += "  }\n}\n";
  return m;
}

// CompileOptionsProto{executable_build_options: {num_replicas: 1, num_partitions: 1}}, by hand:
// field 3 (length-delimited, 4 bytes) holding field 4 = 1 and field 5 = 1 (varints).
const char kCompileOptions[] = {0x1a, 0x04, 0x20, 0x01, 0x28, 0x01};

// -------------------------------------------------------------------------- running a module

struct Device {
  PJRT_Client* client = nullptr;
  PJRT_Device* device = nullptr;
};

std::vector<std::vector<float>> Run(const Pjrt& pjrt, const Device& dev, const std::string& module,
                                    const std::vector<Tensor>& operands,
                                    const std::vector<std::vector<int64_t>>& results) {
  const PJRT_Api* api = pjrt.api();
  Cleanup cleanup;

  // Compile.
  std::string code = module;
  PJRT_Program program;
  std::memset(&program, 0, sizeof program);
  program.struct_size = PJRT_Program_STRUCT_SIZE;
  program.code = &code[0];
  program.code_size = code.size();
  program.format = "mlir";
  program.format_size = 4;
  PJRT_Client_Compile_Args c;
  std::memset(&c, 0, sizeof c);
  c.struct_size = PJRT_Client_Compile_Args_STRUCT_SIZE;
  c.client = dev.client;
  c.program = &program;
  c.compile_options = kCompileOptions;
  c.compile_options_size = sizeof kCompileOptions;
  pjrt.Check(api->PJRT_Client_Compile(&c), "PJRT_Client_Compile");
  PJRT_LoadedExecutable* exe = c.executable;
  cleanup.Add([&pjrt, exe] { pjrt.DestroyLoaded(exe); });

  // Outputs per device.
  PJRT_LoadedExecutable_GetExecutable_Args g;
  std::memset(&g, 0, sizeof g);
  g.struct_size = PJRT_LoadedExecutable_GetExecutable_Args_STRUCT_SIZE;
  g.loaded_executable = exe;
  pjrt.Check(api->PJRT_LoadedExecutable_GetExecutable(&g), "PJRT_LoadedExecutable_GetExecutable");
  PJRT_Executable_NumOutputs_Args no;
  std::memset(&no, 0, sizeof no);
  no.struct_size = PJRT_Executable_NumOutputs_Args_STRUCT_SIZE;
  no.executable = g.executable;
  PJRT_Error* no_err = api->PJRT_Executable_NumOutputs(&no);
  PJRT_Executable_Destroy_Args ed;
  std::memset(&ed, 0, sizeof ed);
  ed.struct_size = PJRT_Executable_Destroy_Args_STRUCT_SIZE;
  ed.executable = g.executable;
  pjrt.Free(api->PJRT_Executable_Destroy(&ed));
  pjrt.Check(no_err, "PJRT_Executable_NumOutputs");
  if (no.num_outputs != results.size()) {
    throw std::runtime_error(Format("executable has %zu outputs, expected %zu", no.num_outputs, results.size()));
  }

  // Inputs: host -> device.
  std::vector<PJRT_Buffer*> inputs;
  for (const Tensor& t : operands) {
    PJRT_Client_BufferFromHostBuffer_Args b;
    std::memset(&b, 0, sizeof b);
    b.struct_size = PJRT_Client_BufferFromHostBuffer_Args_STRUCT_SIZE;
    b.client = dev.client;
    b.data = t.data.data();
    b.type = PJRT_Buffer_Type_F32;
    b.dims = t.dims.data();
    b.num_dims = t.dims.size();
    b.host_buffer_semantics = PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes;
    b.device = dev.device;
    pjrt.Check(api->PJRT_Client_BufferFromHostBuffer(&b), "PJRT_Client_BufferFromHostBuffer");
    PJRT_Buffer* buffer = b.buffer;
    cleanup.Add([&pjrt, buffer] { pjrt.DestroyBuffer(buffer); });
    inputs.push_back(buffer);
    pjrt.AwaitAndFree(b.done_with_host_buffer, "BufferFromHostBuffer's done_with_host_buffer event");
  }

  // Execute on the one device.
  PJRT_ExecuteOptions opts;
  std::memset(&opts, 0, sizeof opts);
  opts.struct_size = PJRT_ExecuteOptions_STRUCT_SIZE;
  std::vector<PJRT_Buffer*> outputs(results.size(), nullptr);
  PJRT_Buffer* const* argument_lists[1] = {inputs.data()};
  PJRT_Buffer** output_lists[1] = {outputs.data()};
  PJRT_Event* done[1] = {nullptr};
  PJRT_LoadedExecutable_Execute_Args e;
  std::memset(&e, 0, sizeof e);
  e.struct_size = PJRT_LoadedExecutable_Execute_Args_STRUCT_SIZE;
  e.executable = exe;
  e.options = &opts;
  e.argument_lists = argument_lists;
  e.num_devices = 1;
  e.num_args = inputs.size();
  e.output_lists = output_lists;
  e.device_complete_events = done;
  pjrt.Check(api->PJRT_LoadedExecutable_Execute(&e), "PJRT_LoadedExecutable_Execute");
  for (PJRT_Buffer* out : outputs) cleanup.Add([&pjrt, out] { pjrt.DestroyBuffer(out); });
  pjrt.AwaitAndFree(done[0], "the execution's device_complete_event");

  // Outputs: device -> host, after checking their type and shape.
  std::vector<std::vector<float>> host(results.size());
  for (size_t i = 0; i < results.size(); ++i) {
    PJRT_Buffer_ElementType_Args et;
    std::memset(&et, 0, sizeof et);
    et.struct_size = PJRT_Buffer_ElementType_Args_STRUCT_SIZE;
    et.buffer = outputs[i];
    pjrt.Check(api->PJRT_Buffer_ElementType(&et), "PJRT_Buffer_ElementType");
    PJRT_Buffer_Dimensions_Args dm;
    std::memset(&dm, 0, sizeof dm);
    dm.struct_size = PJRT_Buffer_Dimensions_Args_STRUCT_SIZE;
    dm.buffer = outputs[i];
    pjrt.Check(api->PJRT_Buffer_Dimensions(&dm), "PJRT_Buffer_Dimensions");
    std::vector<int64_t> dims(dm.dims, dm.dims + dm.num_dims);
    if (et.type != PJRT_Buffer_Type_F32 || dims != results[i]) {
      throw std::runtime_error(Format("output %zu: element type %d, shape (%s); expected f32 (%s)", i,
                                      static_cast<int>(et.type), Dims(dims, ", ").c_str(),
                                      Dims(results[i], ", ").c_str()));
    }
    host[i].assign(static_cast<size_t>(NumElements(results[i])), NAN);
    PJRT_Buffer_ToHostBuffer_Args h;
    std::memset(&h, 0, sizeof h);
    h.struct_size = PJRT_Buffer_ToHostBuffer_Args_STRUCT_SIZE;
    h.src = outputs[i];
    h.dst = host[i].data();
    h.dst_size = host[i].size() * sizeof(float);
    pjrt.Check(api->PJRT_Buffer_ToHostBuffer(&h), "PJRT_Buffer_ToHostBuffer");
    pjrt.AwaitAndFree(h.event, "ToHostBuffer's event");
  }
  return host;
}

// ------------------------------------------------------------------------------ comparisons

// The project's f32 tolerance (tests/suite/common: Tol::F32): relative L2 and max error / max |ref|.
constexpr double kRelL2 = 5e-5;
constexpr double kRelMax = 1e-4;

void Report(bool ok, const std::string& what, const std::string& detail) {
  std::printf("%s  %s%s%s\n", ok ? "PASS" : "FAIL", what.c_str(), detail.empty() ? "" : ": ", detail.c_str());
  if (!ok) ++g_failures;
}

template <typename W>
void Compare(const std::string& what, const std::vector<float>& got, const std::vector<W>& want) {
  if (got.size() != want.size()) {
    Report(false, what, Format("%zu elements, expected %zu", got.size(), want.size()));
    return;
  }
  double diff2 = 0, ref2 = 0, max_diff = 0, max_ref = 0;
  size_t worst = 0, bad = got.size();
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      bad = i;
      break;
    }
    const double d = static_cast<double>(got[i]) - static_cast<double>(want[i]);
    diff2 += d * d;
    ref2 += static_cast<double>(want[i]) * static_cast<double>(want[i]);
    if (std::fabs(d) > max_diff) max_diff = std::fabs(d), worst = i;
    max_ref = std::fmax(max_ref, std::fabs(static_cast<double>(want[i])));
  }
  if (bad != got.size()) {
    Report(false, what, Format("non-finite value %g at flat index %zu", static_cast<double>(got[bad]), bad));
    return;
  }
  const double rel_l2 = std::sqrt(diff2) / std::fmax(std::sqrt(ref2), 1e-30);
  const double rel_max = max_diff / std::fmax(max_ref, 1e-30);
  const bool ok = rel_l2 <= kRelL2 && rel_max <= kRelMax;
  std::string detail = Format("rel_l2 %.2e, max err/max|ref| %.2e (bounds %.0e, %.0e)", rel_l2, rel_max, kRelL2, kRelMax);
  if (max_diff == 0) detail += ", bitwise equal";
  if (!ok) {
    detail += Format("; worst at flat index %zu: got %.9g, want %.9g", worst, static_cast<double>(got[worst]),
                     static_cast<double>(want[worst]));
  }
  Report(ok, what, detail);
}

// ----------------------------------------------------------------------------------- inputs

uint32_t g_rng = 20240601u;
float Uniform(float lo, float hi) {
  g_rng = g_rng * 1664525u + 1013904223u;
  return lo + (hi - lo) * static_cast<float>(g_rng >> 8) / 16777216.0f;
}
Tensor Random(std::vector<int64_t> dims, float lo, float hi) {
  Tensor t{std::move(dims), {}};
  t.data.resize(static_cast<size_t>(NumElements(t.dims)));
  for (float& v : t.data) v = Uniform(lo, hi);
  return t;
}

double Softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }
double Silu(double x) { return x / (1.0 + std::exp(-x)); }

// One target call: operands, attributes, the expected results, and what to check them against.
struct Case {
  std::string name;
  std::string target;
  std::vector<Tensor> operands;
  std::vector<Attr> attrs;
  std::vector<std::string> result_names;
  std::vector<std::vector<int64_t>> result_dims;
  int64_t workspace_bytes = 0;                  // the CUDA workspace result (0: none)
  std::vector<std::vector<float>> capi;         // the library's *_host results
  std::vector<std::vector<double>> naive;       // the loops below, in double
};

// ------------------------------------------------------------------------- selective scan

struct ScanShape {
  int64_t batch, dim, seqlen, dstate;
  int64_t groups;  // 0: time-invariant B, C (dim, dstate)
  bool bld, softplus, has_d, has_z, has_bias, has_h0;
  int64_t checkpoint_len;  // 0: none
};

Case MakeScan(const SsmLib& lib, const std::string& name, const ScanShape& s, bool cuda) {
  const int64_t B = s.batch, D = s.dim, L = s.seqlen, N = s.dstate, G = s.groups;
  const std::vector<int64_t> x_dims = s.bld ? std::vector<int64_t>{B, L, D} : std::vector<int64_t>{B, D, L};
  std::vector<int64_t> bc_dims = {D, N};
  if (G > 0) bc_dims = s.bld ? std::vector<int64_t>{B, L, G, N} : std::vector<int64_t>{B, G, N, L};
  Tensor u = Random(x_dims, -2.f, 2.f);
  Tensor delta = s.softplus ? Random(x_dims, -4.f, 0.5f) : Random(x_dims, 0.01f, 1.f);
  Tensor a = Random({D, N}, -5.f, -0.1f);
  Tensor bm = Random(bc_dims, -1.f, 1.f), cm = Random(bc_dims, -1.f, 1.f);
  Tensor dv = Random({D}, -1.f, 1.f), z = Random(x_dims, -3.f, 3.f), bias = Random({D}, -0.3f, 0.3f);
  Tensor h0 = Random({B, D, N}, -1.f, 1.f);

  Case c;
  c.name = name;
  c.target = "xla_ssm_selective_scan_fwd";
  c.operands = {u, delta, a, bm, cm};
  if (s.has_d) c.operands.push_back(dv);
  if (s.has_z) c.operands.push_back(z);
  if (s.has_bias) c.operands.push_back(bias);
  if (s.has_h0) c.operands.push_back(h0);
  // As _scan.py's _attrs (+ checkpoint_len when the forward saves checkpoints).
  c.attrs = {Bool("delta_softplus", s.softplus), Bool("has_d", s.has_d),       Bool("has_z", s.has_z),
             Bool("has_delta_bias", s.has_bias), Bool("has_initial_state", s.has_h0), Str("layout", s.bld ? "bld" : "bdl")};
  const int64_t n_ck = s.checkpoint_len ? (L + s.checkpoint_len - 1) / s.checkpoint_len : 0;
  if (s.checkpoint_len) c.attrs.push_back(I64("checkpoint_len", s.checkpoint_len));
  c.result_names = {"out", "final_state"};
  c.result_dims = {x_dims, {B, D, N}};
  if (s.checkpoint_len) {
    c.result_names.push_back("checkpoints");
    c.result_dims.push_back({B, D, n_ck, N});
  }
  // jax adds the workspace on CUDA only, when the library asks for one.
  if (cuda) c.workspace_bytes = lib.scan_workspace_bytes(B, D, L, N);

  // The library's host implementation.
  for (const auto& dims : c.result_dims) c.capi.emplace_back(static_cast<size_t>(NumElements(dims)), NAN);
  XlaSsmSelectiveScanFwdArgs args;
  std::memset(&args, 0, sizeof args);
  args.batch = B;
  args.dim = D;
  args.seqlen = L;
  args.dstate = N;
  args.groups = G;
  args.dtype = XLA_SSM_F32;
  args.bc_dtype = XLA_SSM_F32;
  args.layout = s.bld ? XLA_SSM_LAYOUT_BLD : XLA_SSM_LAYOUT_BDL;
  args.delta_softplus = s.softplus;
  args.u = u.data.data();
  args.delta = delta.data.data();
  args.a = a.data.data();
  args.b = bm.data.data();
  args.c = cm.data.data();
  args.d = s.has_d ? dv.data.data() : nullptr;
  args.z = s.has_z ? z.data.data() : nullptr;
  args.delta_bias = s.has_bias ? bias.data.data() : nullptr;
  args.initial_state = s.has_h0 ? h0.data.data() : nullptr;
  args.out = c.capi[0].data();
  args.final_state = c.capi[1].data();
  args.checkpoint_len = s.checkpoint_len;
  args.checkpoints = s.checkpoint_len ? c.capi[2].data() : nullptr;
  if (lib.scan_host(&args) != XLA_SSM_OK) {
    throw std::runtime_error(name + ": xla_ssm_selective_scan_fwd_host failed: " + lib.last_error());
  }

  // The recurrence of docs/selective_scan_fwd.md, in double.
  auto x_at = [&](int64_t b, int64_t d, int64_t l) { return s.bld ? (b * L + l) * D + d : (b * D + d) * L + l; };
  auto bc_at = [&](int64_t b, int64_t d, int64_t n, int64_t l) {
    if (G == 0) return d * N + n;
    const int64_t g = d / (D / G);
    return s.bld ? ((b * L + l) * G + g) * N + n : ((b * G + g) * N + n) * L + l;
  };
  c.naive.resize(c.result_dims.size());
  for (size_t i = 0; i < c.result_dims.size(); ++i) c.naive[i].assign(static_cast<size_t>(NumElements(c.result_dims[i])), 0.0);
  std::vector<double> h(static_cast<size_t>(N));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t n = 0; n < N; ++n) h[n] = s.has_h0 ? h0.data[(b * D + d) * N + n] : 0.0;
      for (int64_t l = 0; l < L; ++l) {
        if (s.checkpoint_len && l % s.checkpoint_len == 0) {
          for (int64_t n = 0; n < N; ++n) c.naive[2][((b * D + d) * n_ck + l / s.checkpoint_len) * N + n] = h[n];
        }
        const int64_t xi = x_at(b, d, l);
        double dt = static_cast<double>(delta.data[xi]) + (s.has_bias ? bias.data[d] : 0.0);
        if (s.softplus) dt = Softplus(dt);
        double y = 0;
        for (int64_t n = 0; n < N; ++n) {
          const int64_t bi = bc_at(b, d, n, l);
          h[n] = std::exp(dt * a.data[d * N + n]) * h[n] + dt * bm.data[bi] * u.data[xi];
          y += cm.data[bi] * h[n];
        }
        if (s.has_d) y += dv.data[d] * static_cast<double>(u.data[xi]);
        if (s.has_z) y *= Silu(z.data[xi]);
        c.naive[0][xi] = y;
      }
      for (int64_t n = 0; n < N; ++n) c.naive[1][(b * D + d) * N + n] = h[n];
    }
  }
  return c;
}

// ------------------------------------------------------------------------------------- SSD

struct SsdShape {
  int64_t batch, seqlen, heads, headdim, dstate, groups, chunk_size;
  int d_rank;  // 0: no D, 1: (heads), 2: (heads, headdim)
  bool has_z, has_bias, has_h0, softplus, save_chunk_states;
  float dt_min, dt_max;
};

Case MakeSsd(const SsmLib& lib, const std::string& name, const SsdShape& s, bool cuda) {
  const int64_t B = s.batch, L = s.seqlen, H = s.heads, P = s.headdim, N = s.dstate, G = s.groups;
  const int64_t K = s.chunk_size, n_chunks = (L + K - 1) / K;
  Tensor x = Random({B, L, H, P}, -2.f, 2.f);
  Tensor dt = s.softplus ? Random({B, L, H}, -4.f, 0.5f) : Random({B, L, H}, 0.001f, 0.8f);
  Tensor a = Random({H}, -4.f, -0.5f);
  Tensor bm = Random({B, L, G, N}, -1.f, 1.f), cm = Random({B, L, G, N}, -1.f, 1.f);
  Tensor dv = s.d_rank == 2 ? Random({H, P}, -1.f, 1.f) : Random({H}, -1.f, 1.f);
  Tensor z = Random({B, L, H, P}, -3.f, 3.f), bias = Random({H}, -0.3f, 0.3f);
  Tensor h0 = Random({B, H, P, N}, -1.f, 1.f);

  if (lib.ssd_chunk_states_dtype(P, N, K, XLA_SSM_F32) != XLA_SSM_F32) {
    throw std::runtime_error(name + ": the library says chunk_states are not f32 for f32 inputs");
  }
  Case c;
  c.name = name;
  c.target = "xla_ssm_ssd_fwd";
  c.operands = {x, dt, a, bm, cm};
  if (s.d_rank) c.operands.push_back(dv);
  if (s.has_z) c.operands.push_back(z);
  if (s.has_bias) c.operands.push_back(bias);
  if (s.has_h0) c.operands.push_back(h0);
  // As _ssd.py's _attrs for the forward.
  c.attrs = {I64("chunk_size", K),          Bool("has_d", s.d_rank > 0),
             Bool("has_z", s.has_z),        Bool("has_dt_bias", s.has_bias),
             Bool("has_initial_states", s.has_h0), Bool("dt_softplus", s.softplus),
             F32("dt_min", s.dt_min),       F32("dt_max", s.dt_max),
             Bool("save_chunk_states", s.save_chunk_states)};
  c.result_names = {"y", "final_states"};
  c.result_dims = {{B, L, H, P}, {B, H, P, N}};
  if (s.save_chunk_states) {
    c.result_names.push_back("chunk_states");
    c.result_dims.push_back({B, H, P, n_chunks, N});
  }
  if (cuda) c.workspace_bytes = lib.ssd_workspace_bytes(B, L, H, P, N, G, K, XLA_SSM_F32);

  for (const auto& dims : c.result_dims) c.capi.emplace_back(static_cast<size_t>(NumElements(dims)), NAN);
  XlaSsmSsdFwdArgs args;
  std::memset(&args, 0, sizeof args);
  args.batch = B;
  args.seqlen = L;
  args.heads = H;
  args.headdim = P;
  args.dstate = N;
  args.groups = G;
  args.chunk_size = K;
  args.dtype = XLA_SSM_F32;
  args.d_per_channel = s.d_rank == 2;
  args.dt_softplus = s.softplus;
  args.dt_min = s.dt_min;
  args.dt_max = s.dt_max;
  args.x = x.data.data();
  args.dt = dt.data.data();
  args.a = a.data.data();
  args.b = bm.data.data();
  args.c = cm.data.data();
  args.d = s.d_rank ? dv.data.data() : nullptr;
  args.z = s.has_z ? z.data.data() : nullptr;
  args.dt_bias = s.has_bias ? bias.data.data() : nullptr;
  args.initial_states = s.has_h0 ? h0.data.data() : nullptr;
  args.y = c.capi[0].data();
  args.final_states = c.capi[1].data();
  args.chunk_states = s.save_chunk_states ? c.capi[2].data() : nullptr;
  args.chunk_states_dtype = XLA_SSM_F32;
  if (lib.ssd_host(&args) != XLA_SSM_OK) {
    throw std::runtime_error(name + ": xla_ssm_ssd_fwd_host failed: " + lib.last_error());
  }

  // The recurrence of docs/ssd.md, in double.
  c.naive.resize(c.result_dims.size());
  for (size_t i = 0; i < c.result_dims.size(); ++i) c.naive[i].assign(static_cast<size_t>(NumElements(c.result_dims[i])), 0.0);
  std::vector<double> st(static_cast<size_t>(P * N));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / G);
      for (int64_t i = 0; i < P * N; ++i) st[i] = s.has_h0 ? h0.data[(b * H + h) * P * N + i] : 0.0;
      for (int64_t t = 0; t < L; ++t) {
        if (s.save_chunk_states && t % K == 0) {
          for (int64_t p = 0; p < P; ++p) {
            for (int64_t n = 0; n < N; ++n) {
              c.naive[2][(((b * H + h) * P + p) * n_chunks + t / K) * N + n] = st[p * N + n];
            }
          }
        }
        double v = static_cast<double>(dt.data[(b * L + t) * H + h]) + (s.has_bias ? bias.data[h] : 0.0);
        if (s.softplus) v = Softplus(v);
        const double d_t = std::fmin(std::fmax(v, static_cast<double>(s.dt_min)), static_cast<double>(s.dt_max));
        const double decay = std::exp(d_t * a.data[h]);
        const float* xt = &x.data[((b * L + t) * H + h) * P];
        const float* bt = &bm.data[((b * L + t) * G + g) * N];
        const float* ct = &cm.data[((b * L + t) * G + g) * N];
        for (int64_t p = 0; p < P; ++p) {
          double y = 0;
          for (int64_t n = 0; n < N; ++n) {
            double& sv = st[p * N + n];
            sv = decay * sv + d_t * xt[p] * bt[n];
            y += sv * ct[n];
          }
          if (s.d_rank) y += (s.d_rank == 2 ? dv.data[h * P + p] : dv.data[h]) * static_cast<double>(xt[p]);
          const int64_t yi = ((b * L + t) * H + h) * P + p;
          if (s.has_z) y *= Silu(z.data[yi]);
          c.naive[0][yi] = y;
        }
      }
      for (int64_t i = 0; i < P * N; ++i) c.naive[1][(b * H + h) * P * N + i] = st[i];
    }
  }
  return c;
}

void RunCase(const Pjrt& pjrt, const Device& dev, const Case& c) {
  // The C API's host results against the naive loop: checks the reference itself.
  for (size_t i = 0; i < c.capi.size(); ++i) {
    Compare(c.name + " " + c.result_names[i] + ": C API host vs naive double loop", c.capi[i], c.naive[i]);
  }
  for (Form form : {Form::kTypedFfi, Form::kJax}) {
    const std::string label = c.name + " [" + FormName(form) + "]";
    const std::string module = BuildModule(c.target, c.operands, c.result_dims, c.workspace_bytes, c.attrs, form);
    if (std::getenv("XLA_SSM_PJRT_PRINT_MLIR")) std::printf("%s", module.c_str());
    std::vector<std::vector<float>> got;
    try {
      got = Run(pjrt, dev, module, c.operands, c.result_dims);
    } catch (const std::exception& e) {
      Report(false, label + " compile and run", e.what());
      continue;
    }
    for (size_t i = 0; i < got.size(); ++i) {
      Compare(label + " " + c.result_names[i] + " vs C API host", got[i], c.capi[i]);
      Compare(label + " " + c.result_names[i] + " vs naive double loop", got[i], c.naive[i]);
    }
  }
}

// Registers `<target>_<suffix>` of the library for `platform` through the FFI extension.
void RegisterHandler(const Pjrt& pjrt, const PJRT_FFI_Extension* ffi, const SsmLib& lib, const std::string& target,
                     const char* suffix, const char* platform) {
  const std::string symbol = target + "_" + suffix;
  void* handler = lib.Sym(symbol.c_str());
  PJRT_FFI_Register_Handler_Args r;
  std::memset(&r, 0, sizeof r);
  r.struct_size = PJRT_FFI_Register_Handler_Args_STRUCT_SIZE;
  r.target_name = target.c_str();
  r.target_name_size = target.size();
  r.handler = handler;
  r.platform_name = platform;
  r.platform_name_size = std::strlen(platform);
  r.traits = static_cast<PJRT_FFI_Handler_TraitsBits>(0);
  pjrt.Check(ffi->register_handler(&r), "PJRT_FFI_Register_Handler");
  std::printf("registered %s as FFI target %s for platform \"%s\"\n", symbol.c_str(), target.c_str(), platform);
}

int Main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <pjrt_plugin.so> <libxla_ssm.so>\n", argv[0]);
    return 2;
  }
  // The plugin: GetPjrtApi, version, initialize.
  void* plugin = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (plugin == nullptr) throw std::runtime_error(Format("dlopen(%s): %s", argv[1], dlerror()));
  auto get_api = reinterpret_cast<PJRT_GetPjrtApi_Fn*>(dlsym(plugin, "GetPjrtApi"));
  if (get_api == nullptr) throw std::runtime_error(Format("%s has no GetPjrtApi", argv[1]));
  const PJRT_Api* api = get_api();
  if (api == nullptr) throw std::runtime_error("GetPjrtApi returned NULL");
  CheckApiVersion(api);
  Pjrt pjrt(api);
  PJRT_Plugin_Initialize_Args init;
  std::memset(&init, 0, sizeof init);
  init.struct_size = PJRT_Plugin_Initialize_Args_STRUCT_SIZE;
  pjrt.Check(api->PJRT_Plugin_Initialize(&init), "PJRT_Plugin_Initialize");
  PrintPluginAttributes(pjrt);
  const PJRT_FFI_Extension* ffi = FindFfiExtension(api);

  SsmLib lib = OpenLibrary(argv[2]);
  std::printf("libxla_ssm %s (%s)\n", lib.version(), argv[2]);

  // The client, its platform and its first device.
  PJRT_Client_Create_Args cc;
  std::memset(&cc, 0, sizeof cc);
  cc.struct_size = PJRT_Client_Create_Args_STRUCT_SIZE;
  pjrt.Check(api->PJRT_Client_Create(&cc), "PJRT_Client_Create");
  Device dev;
  dev.client = cc.client;
  Cleanup client_cleanup;
  client_cleanup.Add([&pjrt, client = cc.client] {
    PJRT_Client_Destroy_Args d;
    std::memset(&d, 0, sizeof d);
    d.struct_size = PJRT_Client_Destroy_Args_STRUCT_SIZE;
    d.client = client;
    pjrt.Free(pjrt.api()->PJRT_Client_Destroy(&d));
  });
  PJRT_Client_PlatformName_Args pn;
  std::memset(&pn, 0, sizeof pn);
  pn.struct_size = PJRT_Client_PlatformName_Args_STRUCT_SIZE;
  pn.client = dev.client;
  pjrt.Check(api->PJRT_Client_PlatformName(&pn), "PJRT_Client_PlatformName");
  const std::string platform(pn.platform_name, pn.platform_name_size);
  PJRT_Client_PlatformVersion_Args pv;
  std::memset(&pv, 0, sizeof pv);
  pv.struct_size = PJRT_Client_PlatformVersion_Args_STRUCT_SIZE;
  pv.client = dev.client;
  pjrt.Check(api->PJRT_Client_PlatformVersion(&pv), "PJRT_Client_PlatformVersion");
  PJRT_Client_AddressableDevices_Args ad;
  std::memset(&ad, 0, sizeof ad);
  ad.struct_size = PJRT_Client_AddressableDevices_Args_STRUCT_SIZE;
  ad.client = dev.client;
  pjrt.Check(api->PJRT_Client_AddressableDevices(&ad), "PJRT_Client_AddressableDevices");
  if (ad.num_addressable_devices == 0) throw std::runtime_error("the client has no addressable device");
  dev.device = ad.addressable_devices[0];
  std::printf("client: platform \"%s\" (%s), %zu addressable device(s)\n", platform.c_str(),
              std::string(pv.platform_version, pv.platform_version_size).c_str(), ad.num_addressable_devices);

  // The handlers, for the client's platform (jax registers "CUDA" and "cpu").
  bool cuda;
  const char *suffix, *ffi_platform;
  if (platform == "cuda") {
    cuda = true, suffix = "cuda", ffi_platform = "CUDA";
  } else if (platform == "cpu") {
    cuda = false, suffix = "cpu", ffi_platform = "cpu";
  } else {
    throw std::runtime_error("platform \"" + platform + "\" has no libxla_ssm handlers (cuda or cpu)");
  }
  for (const char* target : {"xla_ssm_selective_scan_fwd", "xla_ssm_ssd_fwd"}) {
    RegisterHandler(pjrt, ffi, lib, target, suffix, ffi_platform);
  }

  // The cases: the scan with D, z, delta_bias, softplus (and, second, channel-last with
  // time-invariant B/C, an initial state and checkpoints); SSD with D, z, dt_bias, softplus and
  // chunk_states (and, second, groups 2, per-channel D, initial states and a dt clamp).
  std::vector<Case> cases;
  cases.push_back(MakeScan(lib, "selective_scan_fwd bdl b2 d24 l77 n16 groups2 +D+z+bias softplus",
                           {2, 24, 77, 16, 2, false, true, true, true, true, false, 0}, cuda));
  cases.push_back(MakeScan(lib, "selective_scan_fwd bld b2 d24 l77 n16 time-invariant +D+h0 ckpt32",
                           {2, 24, 77, 16, 0, true, false, true, false, false, true, 32}, cuda));
  cases.push_back(MakeSsd(lib, "ssd_fwd b1 l100 h4 p16 n16 g1 chunk32 +D+z+dt_bias softplus +chunk_states",
                          {1, 100, 4, 16, 16, 1, 32, 1, true, true, false, true, true, -INFINITY, INFINITY}, cuda));
  cases.push_back(MakeSsd(lib, "ssd_fwd b2 l77 h4 p8 n16 g2 chunk64 +D(h,p)+h0 clamp[0.01,0.5]",
                          {2, 77, 4, 8, 16, 2, 64, 2, false, false, true, false, false, 0.01f, 0.5f}, cuda));
  for (const Case& c : cases) {
    if (c.workspace_bytes > 0) std::printf("%s: workspace result of %" PRId64 " bytes\n", c.name.c_str(), c.workspace_bytes);
    RunCase(pjrt, dev, c);
  }
  // The plugin stays loaded: unloading XLA's plugins is not supported.
  return g_failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Line-buffered, so that what was printed survives a plugin that aborts (XLA CHECK failures).
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int rc;
  try {
    rc = Main(argc, argv);
  } catch (const std::exception& e) {
    std::printf("FAIL  %s\n", e.what());
    ++g_failures;
    rc = 1;
  }
  std::printf("%d failure(s)\n", g_failures);
  return rc;
}
