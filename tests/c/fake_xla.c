/* A stand-in for the XLA inside a host process (EXLA's libxla_extension.so): it exports
 * XLA_FFI_GetApi, and its XLA_FFI_Handler_Register records each registration after asking the
 * handler for its metadata the way XLA does (a call frame with no API table, as jaxlib <= 0.8.0
 * builds it). tests/suite/xla_registration.rs builds it as a shared library and drives it through
 * xla_registration_host.c. The structs are transcribed from xla/ffi/api/c_api.h (API 0.1 layout). */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_xla.h"

typedef struct Ext {
    size_t struct_size;
    int32_t type;
    struct Ext* next;
} Ext;
typedef struct {
    size_t struct_size;
    Ext* extension_start;
    int32_t major_version;
    int32_t minor_version;
} ApiVersion;
typedef struct {
    const char* ptr;
    size_t len;
} ByteSpan;
typedef struct {
    size_t struct_size;
    Ext* extension_start;
    int64_t size;
    void* types;
    void* items;
} Args;
typedef struct {
    size_t struct_size;
    Ext* extension_start;
    int64_t size;
    void* types;
    void* names;
    void* attrs;
} Attrs;
typedef struct {
    size_t struct_size;
    Ext* extension_start;
    const void* api;
    void* ctx;
    int32_t stage;
    Args args;
    Args rets;
    Attrs attrs;
    void* future;
} CallFrame;
typedef struct {
    size_t struct_size;
    ApiVersion api_version;
    uint32_t traits;
} Metadata;
typedef struct {
    Ext extension_base;
    Metadata* metadata;
} MetadataExtension;
typedef void* (*Handler)(CallFrame*);
typedef struct {
    size_t struct_size;
    Ext* extension_start;
    ByteSpan name;
    ByteSpan platform;
    Handler instantiate, prepare, initialize, execute;
    uint32_t traits;
} RegisterArgs;
typedef struct {
    size_t struct_size;
    Ext* extension_start;
    const char* message;
    int32_t errc;
} ErrorCreateArgs;
typedef struct {
    size_t struct_size;
    Ext* extension_start;
    void* error;
    const char* message;
} ErrorGetMessageArgs;
typedef struct {
    size_t struct_size;
    Ext* extension_start;
    void* error;
} ErrorDestroyArgs;
typedef void (*Entry)(void);
typedef struct {
    size_t struct_size;
    Ext* extension_start;
    ApiVersion api_version;
    const void* internal_api;
    void* (*error_create)(ErrorCreateArgs*);
    void (*error_get_message)(ErrorGetMessageArgs*);
    void (*error_destroy)(ErrorDestroyArgs*);
    void* (*handler_register)(RegisterArgs*);
    Entry stream_get;
} Api;

typedef struct {
    char message[512];
    int32_t errc;
} FakeError;

static void* error_create(ErrorCreateArgs* args) {
    FakeError* e = calloc(1, sizeof *e);
    snprintf(e->message, sizeof e->message, "%s", args->message);
    e->errc = args->errc;
    return e;
}
static void error_get_message(ErrorGetMessageArgs* args) { args->message = ((FakeError*)args->error)->message; }
static void error_destroy(ErrorDestroyArgs* args) { free(args->error); }

enum { kMaxRegistrations = 64 };

static Registration registrations[kMaxRegistrations];
static int num_registrations = 0;
/* When >= 0, the registration with this index is refused (a host rejecting a handler). */
static int refuse_at = -1;

static void* handler_register(RegisterArgs* args) {
    ErrorCreateArgs err = {sizeof(ErrorCreateArgs), NULL, NULL, 3};
    if (args->struct_size < offsetof(RegisterArgs, traits) + sizeof(uint32_t)) {
        err.message = "fake XLA: XLA_FFI_Handler_Register_Args too small";
        return error_create(&err);
    }
    if (num_registrations == refuse_at || num_registrations >= kMaxRegistrations) {
        err.message = "fake XLA: refused (duplicate FFI handler registration)";
        return error_create(&err);
    }
    Registration* r = &registrations[num_registrations];
    memset(r, 0, sizeof *r);
    snprintf(r->name, sizeof r->name, "%.*s", (int)args->name.len, args->name.ptr);
    snprintf(r->platform, sizeof r->platform, "%.*s", (int)args->platform.len, args->platform.ptr);
    r->execute = (void*)args->execute;
    r->traits = args->traits;
    r->args_struct_size = args->struct_size;
    /* The metadata handshake, as XLA runs it at registration: no API table, a 0.1-sized struct. */
    Metadata metadata = {offsetof(Metadata, traits) + sizeof(uint32_t), {sizeof(ApiVersion), NULL, 0, 0}, 0};
    MetadataExtension ext = {{sizeof(MetadataExtension), 1, NULL}, &metadata};
    CallFrame frame;
    memset(&frame, 0, sizeof frame);
    frame.struct_size = offsetof(CallFrame, attrs) + sizeof(Attrs);
    frame.extension_start = &ext.extension_base;
    frame.stage = 3;
    if (args->execute(&frame) != NULL) {
        err.message = "fake XLA: the metadata call failed";
        return error_create(&err);
    }
    r->metadata_major = metadata.api_version.major_version;
    r->metadata_minor = metadata.api_version.minor_version;
    r->metadata_traits = metadata.traits;
    num_registrations++;
    return NULL;
}

static Api api = {
    offsetof(Api, stream_get) + sizeof(Entry),
    NULL,
    {sizeof(ApiVersion), NULL, 0, 2},
    NULL,
    error_create,
    error_get_message,
    error_destroy,
    handler_register,
    NULL,
};

const Api* XLA_FFI_GetApi(void) { return &api; }

int fake_xla_num_registrations(void) { return num_registrations; }
const Registration* fake_xla_registration(int i) { return i < num_registrations ? &registrations[i] : NULL; }
void fake_xla_reset(int refuse_index) {
    num_registrations = 0;
    refuse_at = refuse_index;
}
const void* fake_xla_api(void) { return &api; }
