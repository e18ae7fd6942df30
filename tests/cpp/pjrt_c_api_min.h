/* Minimal PJRT C API declarations for tests/cpp/pjrt_ffi_host.cc: only what that program calls.
 *
 * Written for this project (not a copy of XLA's header). The layouts follow openxla/xla
 * `xla/pjrt/c/pjrt_c_api.h` and `xla/pjrt/c/pjrt_c_api_ffi_extension.h` at PJRT C API version
 * 0.115 (PJRT_API_MAJOR 0, PJRT_API_MINOR 115): the version that the jax 0.11.2 plugins report
 * (`jax-cuda13-pjrt` 0.11.2's xla_cuda_plugin.so, and a CPU plugin built from the same XLA). jaxlib
 * 0.11.2 is jax commit 32544801e26115ac1794926d027148abf3baf009.
 *
 * How the layouts were checked against those binaries (x86-64 Linux, LP64):
 *  - The PJRT_Api function table: 138 slots after the 40-byte header (struct_size 1144), in the
 *    order below, read slot by slot from the CUDA plugin's table and its symbol table (each slot's
 *    function is `pjrt::<name>(<name>_Args*)`). Every slot before the last one used is kept, as an
 *    opaque pointer where unused, so that the offsets match; the rest are kept too so that
 *    sizeof(PJRT_Api) can be checked.
 *  - The argument structs: each static_assert'ed `*_STRUCT_SIZE` below is the size that the 0.115
 *    plugins ask for (their "Unexpected <struct> size: expected N" check) or report (extension
 *    and version structs, the 56-byte stride of their PJRT_NamedValue arrays); PJRT_ExecuteOptions
 *    is the one exception, noted there.
 *  - PJRT_FFI_Extension: extension type 5, struct_size 48, its third entry register_handler;
 *    PJRT_FFI_Register_Handler_Args is 52 bytes (no extension_start, no api_version: typed FFI
 *    handlers only).
 *
 * Conventions as in the published header: every argument struct starts with `struct_size` (set it
 * to the *_STRUCT_SIZE of the fields the caller knows) and `extension_start`; fields marked "out"
 * are written by the plugin. A function returns NULL on success, else a PJRT_Error* that the
 * caller frees with PJRT_Error_Destroy. */
#ifndef XLA_SSM_TESTS_CPP_PJRT_C_API_MIN_H_
#define XLA_SSM_TESTS_CPP_PJRT_C_API_MIN_H_

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#ifndef __cplusplus
#include <assert.h> /* static_assert in C11 */
#endif

#define PJRT_MIN_API_MAJOR 0
#define PJRT_MIN_API_MINOR 115

/* Size of a struct up to and including `last_field` (no tail padding), as PJRT_STRUCT_SIZE. */
#define PJRT_MIN_STRUCT_SIZE(sname, last_field) \
  (offsetof(sname, last_field) + sizeof(((sname*)0)->last_field))

/* typedef + `<sname>_STRUCT_SIZE` + a check of its value against what the 0.115 plugins ask for. */
#define PJRT_MIN_STRUCT(sname, last_field, expected_size)                            \
  typedef struct sname sname;                                                        \
  enum { sname##_STRUCT_SIZE = PJRT_MIN_STRUCT_SIZE(sname, last_field) };            \
  static_assert(sname##_STRUCT_SIZE == (expected_size), #sname " size != PJRT 0.115")

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ extensions */

/* The values up to 16 as in the header; later ones exist in 0.115 (the CUDA plugin's chain also
 * holds types 19, 20 and 24) but are not used here. */
typedef enum {
  PJRT_Extension_Type_Gpu_Custom_Call = 0,
  PJRT_Extension_Type_Profiler = 1,
  PJRT_Extension_Type_Custom_Partitioner = 2,
  PJRT_Extension_Type_Stream = 3,
  PJRT_Extension_Type_Layouts = 4,
  PJRT_Extension_Type_FFI = 5,
  PJRT_Extension_Type_MemoryDescriptions = 6,
  PJRT_Extension_Type_Triton = 7,
  PJRT_Extension_Type_RawBuffer = 8,
  PJRT_Extension_Type_PhaseCompile = 9,
  PJRT_Extension_Type_Example = 10,
  PJRT_Extension_Type_Unknown = 11,
  PJRT_Extension_Type_CrossHostTransfers = 12,
  PJRT_Extension_Type_ExecutableMetadata = 13,
  PJRT_Extension_Type_Callback = 14,
  PJRT_Extension_Type_HostAllocator = 15,
  PJRT_Extension_Type_TpuTopology = 16,
} PJRT_Extension_Type;

struct PJRT_Extension_Base {
  size_t struct_size;
  PJRT_Extension_Type type;
  struct PJRT_Extension_Base* next;
};
PJRT_MIN_STRUCT(PJRT_Extension_Base, next, 24);

/* -------------------------------------------------------------------- version */

struct PJRT_Api_Version {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  int major_version; /* out */
  int minor_version; /* out */
};
PJRT_MIN_STRUCT(PJRT_Api_Version, minor_version, 24);

/* --------------------------------------------------------------------- errors */

typedef struct PJRT_Error PJRT_Error;

typedef enum {
  PJRT_Error_Code_OK = 0,
  PJRT_Error_Code_CANCELLED = 1,
  PJRT_Error_Code_UNKNOWN = 2,
  PJRT_Error_Code_INVALID_ARGUMENT = 3,
  PJRT_Error_Code_DEADLINE_EXCEEDED = 4,
  PJRT_Error_Code_NOT_FOUND = 5,
  PJRT_Error_Code_ALREADY_EXISTS = 6,
  PJRT_Error_Code_PERMISSION_DENIED = 7,
  PJRT_Error_Code_RESOURCE_EXHAUSTED = 8,
  PJRT_Error_Code_FAILED_PRECONDITION = 9,
  PJRT_Error_Code_ABORTED = 10,
  PJRT_Error_Code_OUT_OF_RANGE = 11,
  PJRT_Error_Code_UNIMPLEMENTED = 12,
  PJRT_Error_Code_INTERNAL = 13,
  PJRT_Error_Code_UNAVAILABLE = 14,
  PJRT_Error_Code_DATA_LOSS = 15,
  PJRT_Error_Code_UNAUTHENTICATED = 16,
} PJRT_Error_Code;

struct PJRT_Error_Destroy_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Error* error;
};
PJRT_MIN_STRUCT(PJRT_Error_Destroy_Args, error, 24);
typedef void PJRT_Error_Destroy_Fn(PJRT_Error_Destroy_Args* args);

struct PJRT_Error_Message_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  const PJRT_Error* error;
  const char* message; /* out, lives as long as `error` */
  size_t message_size; /* out */
};
PJRT_MIN_STRUCT(PJRT_Error_Message_Args, message_size, 40);
typedef void PJRT_Error_Message_Fn(PJRT_Error_Message_Args* args);

struct PJRT_Error_GetCode_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  const PJRT_Error* error;
  PJRT_Error_Code code; /* out */
};
PJRT_MIN_STRUCT(PJRT_Error_GetCode_Args, code, 28);
typedef PJRT_Error* PJRT_Error_GetCode_Fn(PJRT_Error_GetCode_Args* args);

/* --------------------------------------------------------------- named values */

typedef enum {
  PJRT_NamedValue_kString = 0,
  PJRT_NamedValue_kInt64 = 1,
  PJRT_NamedValue_kInt64List = 2,
  PJRT_NamedValue_kFloat = 3,
  PJRT_NamedValue_kBool = 4,
} PJRT_NamedValue_Type;

struct PJRT_NamedValue {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  const char* name;
  size_t name_size;
  PJRT_NamedValue_Type type;
  union {
    const char* string_value;
    int64_t int64_value;
    const int64_t* int64_array_value;
    float float_value;
    bool bool_value;
  };
  size_t value_size; /* elements of a list or string; 1 for a scalar */
};
PJRT_MIN_STRUCT(PJRT_NamedValue, value_size, 56);

/* --------------------------------------------------------------------- plugin */

struct PJRT_Plugin_Initialize_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
};
PJRT_MIN_STRUCT(PJRT_Plugin_Initialize_Args, extension_start, 16);
typedef PJRT_Error* PJRT_Plugin_Initialize_Fn(PJRT_Plugin_Initialize_Args* args);

struct PJRT_Plugin_Attributes_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  const PJRT_NamedValue* attributes; /* out, live as long as the process */
  size_t num_attributes;             /* out */
};
PJRT_MIN_STRUCT(PJRT_Plugin_Attributes_Args, num_attributes, 32);
typedef PJRT_Error* PJRT_Plugin_Attributes_Fn(PJRT_Plugin_Attributes_Args* args);

/* --------------------------------------------------------------------- events */

typedef struct PJRT_Event PJRT_Event;

struct PJRT_Event_Destroy_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Event* event;
};
PJRT_MIN_STRUCT(PJRT_Event_Destroy_Args, event, 24);
typedef PJRT_Error* PJRT_Event_Destroy_Fn(PJRT_Event_Destroy_Args* args);

struct PJRT_Event_Await_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Event* event;
};
PJRT_MIN_STRUCT(PJRT_Event_Await_Args, event, 24);
/* Blocks until the event is ready; returns its error status. */
typedef PJRT_Error* PJRT_Event_Await_Fn(PJRT_Event_Await_Args* args);

/* --------------------------------------------------------------------- client */

typedef struct PJRT_Client PJRT_Client;
typedef struct PJRT_Device PJRT_Device;
typedef struct PJRT_Memory PJRT_Memory;
typedef struct PJRT_Executable PJRT_Executable;
typedef struct PJRT_LoadedExecutable PJRT_LoadedExecutable;
typedef struct PJRT_Buffer PJRT_Buffer;
typedef struct PJRT_ExecuteContext PJRT_ExecuteContext;
typedef struct PJRT_Buffer_MemoryLayout PJRT_Buffer_MemoryLayout;
typedef struct PJRT_SendCallbackInfo PJRT_SendCallbackInfo;
typedef struct PJRT_RecvCallbackInfo PJRT_RecvCallbackInfo;
typedef struct PJRT_MultiSlice_Config PJRT_MultiSlice_Config;

/* The key-value store callbacks of PJRT_Client_Create (pointers to functions taking their
 * *_Args); a single-process client passes NULL, so they stay opaque here. */
typedef void* PJRT_KeyValueCallback_Opaque;

struct PJRT_Client_Create_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  const PJRT_NamedValue* create_options;
  size_t num_options;
  PJRT_KeyValueCallback_Opaque kv_get_callback;
  void* kv_get_user_arg;
  PJRT_KeyValueCallback_Opaque kv_put_callback;
  void* kv_put_user_arg;
  PJRT_Client* client; /* out */
  PJRT_KeyValueCallback_Opaque kv_try_get_callback;
  void* kv_try_get_user_arg;
};
PJRT_MIN_STRUCT(PJRT_Client_Create_Args, kv_try_get_user_arg, 88);
typedef PJRT_Error* PJRT_Client_Create_Fn(PJRT_Client_Create_Args* args);

struct PJRT_Client_Destroy_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Client* client;
};
PJRT_MIN_STRUCT(PJRT_Client_Destroy_Args, client, 24);
typedef PJRT_Error* PJRT_Client_Destroy_Fn(PJRT_Client_Destroy_Args* args);

struct PJRT_Client_PlatformName_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Client* client;
  const char* platform_name; /* out, e.g. "cpu", "cuda" */
  size_t platform_name_size; /* out */
};
PJRT_MIN_STRUCT(PJRT_Client_PlatformName_Args, platform_name_size, 40);
typedef PJRT_Error* PJRT_Client_PlatformName_Fn(PJRT_Client_PlatformName_Args* args);

struct PJRT_Client_PlatformVersion_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Client* client;
  const char* platform_version; /* out */
  size_t platform_version_size; /* out */
};
PJRT_MIN_STRUCT(PJRT_Client_PlatformVersion_Args, platform_version_size, 40);
typedef PJRT_Error* PJRT_Client_PlatformVersion_Fn(PJRT_Client_PlatformVersion_Args* args);

struct PJRT_Client_AddressableDevices_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Client* client;
  PJRT_Device* const* addressable_devices; /* out */
  size_t num_addressable_devices;          /* out */
};
PJRT_MIN_STRUCT(PJRT_Client_AddressableDevices_Args, num_addressable_devices, 40);
typedef PJRT_Error* PJRT_Client_AddressableDevices_Fn(PJRT_Client_AddressableDevices_Args* args);

/* A program to compile: `format` "mlir" (StableHLO/MHLO text or bytecode) or "hlo". */
struct PJRT_Program {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  char* code;
  size_t code_size;
  const char* format;
  size_t format_size;
};
PJRT_MIN_STRUCT(PJRT_Program, format_size, 48);

struct PJRT_Client_Compile_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Client* client;
  const PJRT_Program* program;
  const char* compile_options; /* a serialized xla.CompileOptionsProto */
  size_t compile_options_size;
  PJRT_LoadedExecutable* executable; /* out */
};
PJRT_MIN_STRUCT(PJRT_Client_Compile_Args, executable, 56);
typedef PJRT_Error* PJRT_Client_Compile_Fn(PJRT_Client_Compile_Args* args);

/* Element types (only F32 and U8 are used here; the rest keep the numbering). */
typedef enum {
  PJRT_Buffer_Type_INVALID = 0,
  PJRT_Buffer_Type_PRED = 1,
  PJRT_Buffer_Type_S8 = 2,
  PJRT_Buffer_Type_S16 = 3,
  PJRT_Buffer_Type_S32 = 4,
  PJRT_Buffer_Type_S64 = 5,
  PJRT_Buffer_Type_U8 = 6,
  PJRT_Buffer_Type_U16 = 7,
  PJRT_Buffer_Type_U32 = 8,
  PJRT_Buffer_Type_U64 = 9,
  PJRT_Buffer_Type_F16 = 10,
  PJRT_Buffer_Type_F32 = 11,
  PJRT_Buffer_Type_F64 = 12,
  PJRT_Buffer_Type_BF16 = 13,
} PJRT_Buffer_Type;

typedef enum {
  /* The data is copied before the call returns. */
  PJRT_HostBufferSemantics_kImmutableOnlyDuringCall = 0,
  /* The data must stay valid until `done_with_host_buffer` is ready. */
  PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes = 1,
  PJRT_HostBufferSemantics_kImmutableZeroCopy = 2,
  PJRT_HostBufferSemantics_kMutableZeroCopy = 3,
} PJRT_HostBufferSemantics;

struct PJRT_Client_BufferFromHostBuffer_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Client* client;
  const void* data;
  PJRT_Buffer_Type type;
  const int64_t* dims;
  size_t num_dims;
  const int64_t* byte_strides; /* NULL: dense row-major */
  size_t num_byte_strides;
  PJRT_HostBufferSemantics host_buffer_semantics;
  PJRT_Device* device;
  PJRT_Memory* memory;                     /* NULL: the device's default memory */
  PJRT_Buffer_MemoryLayout* device_layout; /* NULL: the default layout */
  PJRT_Event* done_with_host_buffer;       /* out */
  PJRT_Buffer* buffer;                     /* out */
};
PJRT_MIN_STRUCT(PJRT_Client_BufferFromHostBuffer_Args, buffer, 120);
typedef PJRT_Error* PJRT_Client_BufferFromHostBuffer_Fn(PJRT_Client_BufferFromHostBuffer_Args* args);

/* ----------------------------------------------------------------- executables */

struct PJRT_Executable_Destroy_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Executable* executable;
};
PJRT_MIN_STRUCT(PJRT_Executable_Destroy_Args, executable, 24);
typedef PJRT_Error* PJRT_Executable_Destroy_Fn(PJRT_Executable_Destroy_Args* args);

struct PJRT_Executable_NumOutputs_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Executable* executable;
  size_t num_outputs; /* out */
};
PJRT_MIN_STRUCT(PJRT_Executable_NumOutputs_Args, num_outputs, 32);
typedef PJRT_Error* PJRT_Executable_NumOutputs_Fn(PJRT_Executable_NumOutputs_Args* args);

struct PJRT_LoadedExecutable_Destroy_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_LoadedExecutable* executable;
};
PJRT_MIN_STRUCT(PJRT_LoadedExecutable_Destroy_Args, executable, 24);
typedef PJRT_Error* PJRT_LoadedExecutable_Destroy_Fn(PJRT_LoadedExecutable_Destroy_Args* args);

/* The returned executable is the caller's, to free with PJRT_Executable_Destroy. */
struct PJRT_LoadedExecutable_GetExecutable_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_LoadedExecutable* loaded_executable;
  PJRT_Executable* executable; /* out */
};
PJRT_MIN_STRUCT(PJRT_LoadedExecutable_GetExecutable_Args, executable, 32);
typedef PJRT_Error* PJRT_LoadedExecutable_GetExecutable_Fn(PJRT_LoadedExecutable_GetExecutable_Args* args);

/* The 0.115 plugins ask for at least 112 bytes (through incarnation_ids); multi_slice_config
 * follows it in the 0.115 header and is passed as NULL. */
struct PJRT_ExecuteOptions {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_SendCallbackInfo** send_callbacks;
  PJRT_RecvCallbackInfo** recv_callbacks;
  size_t num_send_ops;
  size_t num_recv_ops;
  int launch_id;
  const int64_t* non_donatable_input_indices;
  size_t num_non_donatable_input_indices;
  PJRT_ExecuteContext* context;
  const char* call_location;
  size_t num_tasks;
  int* task_ids;
  int64_t* incarnation_ids;
  PJRT_MultiSlice_Config* multi_slice_config;
};
PJRT_MIN_STRUCT(PJRT_ExecuteOptions, multi_slice_config, 120);
static_assert(PJRT_MIN_STRUCT_SIZE(PJRT_ExecuteOptions, incarnation_ids) == 112,
              "PJRT_ExecuteOptions: the 0.115 plugins' minimum is 112 bytes");

struct PJRT_LoadedExecutable_Execute_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_LoadedExecutable* executable;
  PJRT_ExecuteOptions* options;
  PJRT_Buffer* const* const* argument_lists; /* [num_devices][num_args] */
  size_t num_devices;
  size_t num_args;
  PJRT_Buffer** const* output_lists;   /* [num_devices][num_outputs], filled in; caller frees */
  PJRT_Event** device_complete_events; /* [num_devices] or NULL; out events, caller frees */
  PJRT_Device* execute_device;         /* NULL: the compile-time device assignment */
};
PJRT_MIN_STRUCT(PJRT_LoadedExecutable_Execute_Args, execute_device, 80);
typedef PJRT_Error* PJRT_LoadedExecutable_Execute_Fn(PJRT_LoadedExecutable_Execute_Args* args);

/* -------------------------------------------------------------------- buffers */

struct PJRT_Buffer_Destroy_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Buffer* buffer;
};
PJRT_MIN_STRUCT(PJRT_Buffer_Destroy_Args, buffer, 24);
typedef PJRT_Error* PJRT_Buffer_Destroy_Fn(PJRT_Buffer_Destroy_Args* args);

struct PJRT_Buffer_ElementType_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Buffer* buffer;
  PJRT_Buffer_Type type; /* out */
};
PJRT_MIN_STRUCT(PJRT_Buffer_ElementType_Args, type, 28);
typedef PJRT_Error* PJRT_Buffer_ElementType_Fn(PJRT_Buffer_ElementType_Args* args);

struct PJRT_Buffer_Dimensions_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Buffer* buffer;
  const int64_t* dims; /* out, lives as long as the buffer */
  size_t num_dims;     /* out */
};
PJRT_MIN_STRUCT(PJRT_Buffer_Dimensions_Args, num_dims, 40);
typedef PJRT_Error* PJRT_Buffer_Dimensions_Fn(PJRT_Buffer_Dimensions_Args* args);

/* Asynchronous copy to host memory; `event` is ready when `dst` is written. With dst NULL it
 * only reports the needed `dst_size`. */
struct PJRT_Buffer_ToHostBuffer_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Buffer* src;
  PJRT_Buffer_MemoryLayout* host_layout; /* NULL: dense row-major */
  void* dst;
  size_t dst_size;
  PJRT_Event* event; /* out */
};
PJRT_MIN_STRUCT(PJRT_Buffer_ToHostBuffer_Args, event, 56);
typedef PJRT_Error* PJRT_Buffer_ToHostBuffer_Fn(PJRT_Buffer_ToHostBuffer_Args* args);

/* ------------------------------------------------------------------ PJRT_Api */

/* An entry of the function table that this program never calls. */
typedef void (*PJRT_OpaqueFn)(void);

/* Returned by the plugin's `GetPjrtApi`. The function table, in header order for 0.115. */
typedef struct PJRT_Api {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Api_Version pjrt_api_version;
  PJRT_Error_Destroy_Fn* PJRT_Error_Destroy;  // [0] +40
  PJRT_Error_Message_Fn* PJRT_Error_Message;  // [1] +48
  PJRT_Error_GetCode_Fn* PJRT_Error_GetCode;  // [2] +56
  PJRT_Plugin_Initialize_Fn* PJRT_Plugin_Initialize;  // [3] +64
  PJRT_Plugin_Attributes_Fn* PJRT_Plugin_Attributes;  // [4] +72
  PJRT_Event_Destroy_Fn* PJRT_Event_Destroy;  // [5] +80
  PJRT_OpaqueFn PJRT_Event_IsReady;  // [6] +88
  PJRT_OpaqueFn PJRT_Event_Error;  // [7] +96
  PJRT_Event_Await_Fn* PJRT_Event_Await;  // [8] +104
  PJRT_OpaqueFn PJRT_Event_OnReady;  // [9] +112
  PJRT_Client_Create_Fn* PJRT_Client_Create;  // [10] +120
  PJRT_Client_Destroy_Fn* PJRT_Client_Destroy;  // [11] +128
  PJRT_Client_PlatformName_Fn* PJRT_Client_PlatformName;  // [12] +136
  PJRT_OpaqueFn PJRT_Client_ProcessIndex;  // [13] +144
  PJRT_Client_PlatformVersion_Fn* PJRT_Client_PlatformVersion;  // [14] +152
  PJRT_OpaqueFn PJRT_Client_Devices;  // [15] +160
  PJRT_Client_AddressableDevices_Fn* PJRT_Client_AddressableDevices;  // [16] +168
  PJRT_OpaqueFn PJRT_Client_LookupDevice;  // [17] +176
  PJRT_OpaqueFn PJRT_Client_LookupAddressableDevice;  // [18] +184
  PJRT_OpaqueFn PJRT_Client_AddressableMemories;  // [19] +192
  PJRT_Client_Compile_Fn* PJRT_Client_Compile;  // [20] +200
  PJRT_OpaqueFn PJRT_Client_DefaultDeviceAssignment;  // [21] +208
  PJRT_Client_BufferFromHostBuffer_Fn* PJRT_Client_BufferFromHostBuffer;  // [22] +216
  PJRT_OpaqueFn PJRT_DeviceDescription_Id;  // [23] +224
  PJRT_OpaqueFn PJRT_DeviceDescription_ProcessIndex;  // [24] +232
  PJRT_OpaqueFn PJRT_DeviceDescription_Attributes;  // [25] +240
  PJRT_OpaqueFn PJRT_DeviceDescription_Kind;  // [26] +248
  PJRT_OpaqueFn PJRT_DeviceDescription_DebugString;  // [27] +256
  PJRT_OpaqueFn PJRT_DeviceDescription_ToString;  // [28] +264
  PJRT_OpaqueFn PJRT_Device_GetDescription;  // [29] +272
  PJRT_OpaqueFn PJRT_Device_IsAddressable;  // [30] +280
  PJRT_OpaqueFn PJRT_Device_LocalHardwareId;  // [31] +288
  PJRT_OpaqueFn PJRT_Device_AddressableMemories;  // [32] +296
  PJRT_OpaqueFn PJRT_Device_DefaultMemory;  // [33] +304
  PJRT_OpaqueFn PJRT_Device_MemoryStats;  // [34] +312
  PJRT_OpaqueFn PJRT_Memory_Id;  // [35] +320
  PJRT_OpaqueFn PJRT_Memory_Kind;  // [36] +328
  PJRT_OpaqueFn PJRT_Memory_DebugString;  // [37] +336
  PJRT_OpaqueFn PJRT_Memory_ToString;  // [38] +344
  PJRT_OpaqueFn PJRT_Memory_AddressableByDevices;  // [39] +352
  PJRT_Executable_Destroy_Fn* PJRT_Executable_Destroy;  // [40] +360
  PJRT_OpaqueFn PJRT_Executable_Name;  // [41] +368
  PJRT_OpaqueFn PJRT_Executable_NumReplicas;  // [42] +376
  PJRT_OpaqueFn PJRT_Executable_NumPartitions;  // [43] +384
  PJRT_Executable_NumOutputs_Fn* PJRT_Executable_NumOutputs;  // [44] +392
  PJRT_OpaqueFn PJRT_Executable_SizeOfGeneratedCodeInBytes;  // [45] +400
  PJRT_OpaqueFn PJRT_Executable_GetCostAnalysis;  // [46] +408
  PJRT_OpaqueFn PJRT_Executable_OutputMemoryKinds;  // [47] +416
  PJRT_OpaqueFn PJRT_Executable_OptimizedProgram;  // [48] +424
  PJRT_OpaqueFn PJRT_Executable_Serialize;  // [49] +432
  PJRT_LoadedExecutable_Destroy_Fn* PJRT_LoadedExecutable_Destroy;  // [50] +440
  PJRT_LoadedExecutable_GetExecutable_Fn* PJRT_LoadedExecutable_GetExecutable;  // [51] +448
  PJRT_OpaqueFn PJRT_LoadedExecutable_AddressableDevices;  // [52] +456
  PJRT_OpaqueFn PJRT_LoadedExecutable_Delete;  // [53] +464
  PJRT_OpaqueFn PJRT_LoadedExecutable_IsDeleted;  // [54] +472
  PJRT_LoadedExecutable_Execute_Fn* PJRT_LoadedExecutable_Execute;  // [55] +480
  PJRT_OpaqueFn PJRT_Executable_DeserializeAndLoad;  // [56] +488
  PJRT_OpaqueFn PJRT_LoadedExecutable_Fingerprint;  // [57] +496
  PJRT_Buffer_Destroy_Fn* PJRT_Buffer_Destroy;  // [58] +504
  PJRT_Buffer_ElementType_Fn* PJRT_Buffer_ElementType;  // [59] +512
  PJRT_Buffer_Dimensions_Fn* PJRT_Buffer_Dimensions;  // [60] +520
  PJRT_OpaqueFn PJRT_Buffer_UnpaddedDimensions;  // [61] +528
  PJRT_OpaqueFn PJRT_Buffer_DynamicDimensionIndices;  // [62] +536
  PJRT_OpaqueFn PJRT_Buffer_GetMemoryLayout;  // [63] +544
  PJRT_OpaqueFn PJRT_Buffer_OnDeviceSizeInBytes;  // [64] +552
  PJRT_OpaqueFn PJRT_Buffer_Device;  // [65] +560
  PJRT_OpaqueFn PJRT_Buffer_Memory;  // [66] +568
  PJRT_OpaqueFn PJRT_Buffer_Delete;  // [67] +576
  PJRT_OpaqueFn PJRT_Buffer_IsDeleted;  // [68] +584
  PJRT_OpaqueFn PJRT_Buffer_CopyToDevice;  // [69] +592
  PJRT_Buffer_ToHostBuffer_Fn* PJRT_Buffer_ToHostBuffer;  // [70] +600
  PJRT_OpaqueFn PJRT_Buffer_IsOnCpu;  // [71] +608
  PJRT_OpaqueFn PJRT_Buffer_ReadyEvent;  // [72] +616
  PJRT_OpaqueFn PJRT_Buffer_UnsafePointer;  // [73] +624
  PJRT_OpaqueFn PJRT_Buffer_IncreaseExternalReferenceCount;  // [74] +632
  PJRT_OpaqueFn PJRT_Buffer_DecreaseExternalReferenceCount;  // [75] +640
  PJRT_OpaqueFn PJRT_Buffer_OpaqueDeviceMemoryDataPointer;  // [76] +648
  PJRT_OpaqueFn PJRT_CopyToDeviceStream_Destroy;  // [77] +656
  PJRT_OpaqueFn PJRT_CopyToDeviceStream_AddChunk;  // [78] +664
  PJRT_OpaqueFn PJRT_CopyToDeviceStream_TotalBytes;  // [79] +672
  PJRT_OpaqueFn PJRT_CopyToDeviceStream_GranuleSize;  // [80] +680
  PJRT_OpaqueFn PJRT_CopyToDeviceStream_CurrentBytes;  // [81] +688
  PJRT_OpaqueFn PJRT_TopologyDescription_Create;  // [82] +696
  PJRT_OpaqueFn PJRT_TopologyDescription_Destroy;  // [83] +704
  PJRT_OpaqueFn PJRT_TopologyDescription_PlatformName;  // [84] +712
  PJRT_OpaqueFn PJRT_TopologyDescription_PlatformVersion;  // [85] +720
  PJRT_OpaqueFn PJRT_TopologyDescription_GetDeviceDescriptions;  // [86] +728
  PJRT_OpaqueFn PJRT_TopologyDescription_Serialize;  // [87] +736
  PJRT_OpaqueFn PJRT_TopologyDescription_Attributes;  // [88] +744
  PJRT_OpaqueFn PJRT_Compile;  // [89] +752
  PJRT_OpaqueFn PJRT_Executable_OutputElementTypes;  // [90] +760
  PJRT_OpaqueFn PJRT_Executable_OutputDimensions;  // [91] +768
  PJRT_OpaqueFn PJRT_Buffer_CopyToMemory;  // [92] +776
  PJRT_OpaqueFn PJRT_Client_CreateViewOfDeviceBuffer;  // [93] +784
  PJRT_OpaqueFn PJRT_Executable_Fingerprint;  // [94] +792
  PJRT_OpaqueFn PJRT_Client_TopologyDescription;  // [95] +800
  PJRT_OpaqueFn PJRT_Executable_GetCompiledMemoryStats;  // [96] +808
  PJRT_OpaqueFn PJRT_Memory_Kind_Id;  // [97] +816
  PJRT_OpaqueFn PJRT_ExecuteContext_Create;  // [98] +824
  PJRT_OpaqueFn PJRT_ExecuteContext_Destroy;  // [99] +832
  PJRT_OpaqueFn PJRT_Buffer_CopyRawToHost;  // [100] +840
  PJRT_OpaqueFn PJRT_AsyncHostToDeviceTransferManager_Destroy;  // [101] +848
  PJRT_OpaqueFn PJRT_AsyncHostToDeviceTransferManager_TransferData;  // [102] +856
  PJRT_OpaqueFn PJRT_Client_CreateBuffersForAsyncHostToDevice;  // [103] +864
  PJRT_OpaqueFn PJRT_AsyncHostToDeviceTransferManager_RetrieveBuffer;  // [104] +872
  PJRT_OpaqueFn PJRT_AsyncHostToDeviceTransferManager_Device;  // [105] +880
  PJRT_OpaqueFn PJRT_AsyncHostToDeviceTransferManager_BufferCount;  // [106] +888
  PJRT_OpaqueFn PJRT_AsyncHostToDeviceTransferManager_BufferSize;  // [107] +896
  PJRT_OpaqueFn PJRT_AsyncHostToDeviceTransferManager_SetBufferError;  // [108] +904
  PJRT_OpaqueFn PJRT_AsyncHostToDeviceTransferManager_AddMetadata;  // [109] +912
  PJRT_OpaqueFn PJRT_Client_DmaMap;  // [110] +920
  PJRT_OpaqueFn PJRT_Client_DmaUnmap;  // [111] +928
  PJRT_OpaqueFn PJRT_Client_CreateUninitializedBuffer;  // [112] +936
  PJRT_OpaqueFn PJRT_Client_UpdateGlobalProcessInfo;  // [113] +944
  PJRT_OpaqueFn PJRT_TopologyDescription_Deserialize;  // [114] +952
  PJRT_OpaqueFn PJRT_Client_CreateAliasBuffer;  // [115] +960
  PJRT_OpaqueFn PJRT_Client_FulfillAliasBuffer;  // [116] +968
  PJRT_OpaqueFn PJRT_LoadedExecutable_GetDeviceAssignment;  // [117] +976
  PJRT_OpaqueFn PJRT_Client_CreateErrorBuffer;  // [118] +984
  PJRT_OpaqueFn PJRT_AsyncHostToDeviceTransferManager_TransferLiteral;  // [119] +992
  PJRT_OpaqueFn PJRT_Buffer_CopyRawToHostFuture;  // [120] +1000
  PJRT_OpaqueFn PJRT_Device_PoisonExecution;  // [121] +1008
  PJRT_OpaqueFn PJRT_Device_CreateAsyncTrackingEvent;  // [122] +1016
  PJRT_OpaqueFn PJRT_AsyncTrackingEvent_Destroy;  // [123] +1024
  PJRT_OpaqueFn PJRT_Executable_GetCompileOptions;  // [124] +1032
  PJRT_OpaqueFn PJRT_Buffer_DonateWithControlDependency;  // [125] +1040
  PJRT_OpaqueFn PJRT_Event_Create;  // [126] +1048
  PJRT_OpaqueFn PJRT_Event_Set;  // [127] +1056
  PJRT_OpaqueFn PJRT_Device_GetAttributes;  // [128] +1064
  PJRT_OpaqueFn PJRT_Client_Load;  // [129] +1072
  PJRT_OpaqueFn PJRT_LoadedExecutable_AddressableDeviceLogicalIds;  // [130] +1080
  PJRT_OpaqueFn PJRT_Buffer_Bitcast;  // [131] +1088
  PJRT_OpaqueFn PJRT_Error_ForEachPayload;  // [132] +1096
  PJRT_OpaqueFn PJRT_TopologyDescription_Fingerprint;  // [133] +1104
  PJRT_OpaqueFn PJRT_Executable_ParameterMemoryKinds;  // [134] +1112
  PJRT_OpaqueFn PJRT_Device_ClearMemoryStats;  // [135] +1120
  PJRT_OpaqueFn PJRT_TopologyDescription_MakeCanonicalShapeForMemorySpace;  // [136] +1128
  PJRT_OpaqueFn PJRT_TopologyDescription_GetMemorySpaceKindIds;  // [137] +1136
} PJRT_Api;

/* 40-byte header, then 138 function pointers: the struct_size that the 0.115 plugins report. */
static_assert(sizeof(PJRT_Api) == 1144, "PJRT_Api: 0.115 has 138 entries");
static_assert(offsetof(PJRT_Api, PJRT_Error_Destroy) == 40, "PJRT_Api layout");
static_assert(offsetof(PJRT_Api, PJRT_Plugin_Initialize) == 64, "PJRT_Api layout");
static_assert(offsetof(PJRT_Api, PJRT_Event_Await) == 104, "PJRT_Api layout");
static_assert(offsetof(PJRT_Api, PJRT_Client_Create) == 120, "PJRT_Api layout");
static_assert(offsetof(PJRT_Api, PJRT_Client_AddressableDevices) == 168, "PJRT_Api layout");
static_assert(offsetof(PJRT_Api, PJRT_Client_Compile) == 200, "PJRT_Api layout");
static_assert(offsetof(PJRT_Api, PJRT_Client_BufferFromHostBuffer) == 216, "PJRT_Api layout");
static_assert(offsetof(PJRT_Api, PJRT_Executable_Destroy) == 360, "PJRT_Api layout");
static_assert(offsetof(PJRT_Api, PJRT_Executable_NumOutputs) == 392, "PJRT_Api layout");
static_assert(offsetof(PJRT_Api, PJRT_LoadedExecutable_Destroy) == 440, "PJRT_Api layout");
static_assert(offsetof(PJRT_Api, PJRT_LoadedExecutable_Execute) == 480, "PJRT_Api layout");
static_assert(offsetof(PJRT_Api, PJRT_Buffer_Destroy) == 504, "PJRT_Api layout");
static_assert(offsetof(PJRT_Api, PJRT_Buffer_ToHostBuffer) == 600, "PJRT_Api layout");
static_assert(offsetof(PJRT_Api, PJRT_Compile) == 752, "PJRT_Api layout");
static_assert(offsetof(PJRT_Api, PJRT_TopologyDescription_GetMemorySpaceKindIds) == 1136,
              "PJRT_Api layout");

/* The plugin's one exported symbol. */
typedef const PJRT_Api* PJRT_GetPjrtApi_Fn(void);

/* ------------------------------------------------------- FFI extension (type 5) */

/* Bits of PJRT_FFI_Register_Handler_Args.traits. */
typedef enum PJRT_FFI_Handler_TraitsBits {
  PJRT_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE = 1u << 0,
} PJRT_FFI_Handler_TraitsBits;

/* Registers a typed-FFI handler (an `XLA_FFI_Error* (*)(XLA_FFI_CallFrame*)`, i.e. custom calls
 * with api_version 4) for `target_name` on `platform_name` ("CUDA", "cpu"/"Host", ...) in the
 * plugin's XLA. Unlike most argument structs this one has no extension_start. */
struct PJRT_FFI_Register_Handler_Args {
  size_t struct_size;
  const char* target_name;
  size_t target_name_size;
  void* handler;
  const char* platform_name;
  size_t platform_name_size;
  PJRT_FFI_Handler_TraitsBits traits;
};
PJRT_MIN_STRUCT(PJRT_FFI_Register_Handler_Args, traits, 52);
typedef PJRT_Error* PJRT_FFI_Register_Handler_Fn(PJRT_FFI_Register_Handler_Args* args);

/* Found in PJRT_Api.extension_start's chain by base.type == PJRT_Extension_Type_FFI. The first
 * two entries (type registration, user data) are not used here. */
struct PJRT_FFI_Extension {
  PJRT_Extension_Base base;
  PJRT_OpaqueFn type_register;
  PJRT_OpaqueFn user_data_add;
  PJRT_FFI_Register_Handler_Fn* register_handler;
};
PJRT_MIN_STRUCT(PJRT_FFI_Extension, register_handler, 48);

#ifdef __cplusplus
}
#endif

#endif /* XLA_SSM_TESTS_CPP_PJRT_C_API_MIN_H_ */
