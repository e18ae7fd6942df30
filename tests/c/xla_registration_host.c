/* A host process the way EXLA is one: XLA lives in a library loaded with RTLD_LOCAL (Erlang loads
 * NIFs so), then libxla_ssm.so is opened with RTLD_NOW | RTLD_GLOBAL (EXLA's load_dylib) and must
 * register its targets with that XLA by itself. Then xla_ssm_register_xla_targets is called directly.
 *
 *   xla_registration_host <libfake_xla.so | -> <libxla_ssm.so>
 *
 * With "-" no XLA is loaded: opening the library must register nothing and print nothing.
 * Prints one line per registration the fake XLA recorded, then the explicit calls' results;
 * tests/suite/xla_registration.rs checks the lines. Exit status 0 unless a step could not run. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "fake_xla.h"
#include "xla_ssm.h"

typedef int (*NumFn)(void);
typedef const Registration* (*GetFn)(int);
typedef void (*ResetFn)(int);
typedef const void* (*ApiFn)(void);
typedef XlaSsmStatus (*RegisterFn)(const XLA_FFI_Api*, const char*);
typedef const char* (*LastErrorFn)(void);

static void* must_sym(void* handle, const char* name) {
    void* sym = dlsym(handle, name);
    if (!sym) fprintf(stderr, "missing symbol %s: %s\n", name, dlerror());
    return sym;
}

/* One line per recorded registration; `exec` says whether the handler is the library's export of
 * <name>_cpu (Host) or <name>_cuda (CUDA). */
static void print_registrations(void* fake, void* lib) {
    NumFn num = (NumFn)must_sym(fake, "fake_xla_num_registrations");
    GetFn get = (GetFn)must_sym(fake, "fake_xla_registration");
    for (int i = 0; i < num(); ++i) {
        const Registration* r = get(i);
        char symbol[160];
        int cuda = strcmp(r->platform, "CUDA") == 0;
        snprintf(symbol, sizeof symbol, "%s_%s", r->name, cuda ? "cuda" : "cpu");
        void* expected = dlsym(lib, symbol);
        printf("registered %s %s exec=%s traits=%u args_size=%zu metadata=%d.%d metadata_traits=%u\n", r->name,
               r->platform, expected && expected == r->execute ? "ok" : "WRONG", r->traits, r->args_struct_size,
               r->metadata_major, r->metadata_minor, r->metadata_traits);
    }
}

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s <libfake_xla.so | -> <libxla_ssm.so>\n", argv[0]);
        return 2;
    }
    void* fake = NULL;
    if (strcmp(argv[1], "-") != 0) {
        fake = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
        if (!fake) {
            fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
            return 2;
        }
        /* The point of the exercise: the table is not in the global scope. */
        printf("XLA_FFI_GetApi in the global scope: %s\n", dlsym(RTLD_DEFAULT, "XLA_FFI_GetApi") ? "yes" : "no");
    }
    void* lib = dlopen(argv[2], RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        fprintf(stderr, "dlopen %s: %s\n", argv[2], dlerror());
        return 2;
    }
    printf("loaded\n");
    if (!fake) {
        printf("done\n");
        return 0;
    }
    print_registrations(fake, lib);

    ResetFn reset = (ResetFn)must_sym(fake, "fake_xla_reset");
    ApiFn api = (ApiFn)must_sym(fake, "fake_xla_api");
    RegisterFn reg = (RegisterFn)must_sym(lib, "xla_ssm_register_xla_targets");
    LastErrorFn last_error = (LastErrorFn)must_sym(lib, "xla_ssm_last_error");
    NumFn num = (NumFn)must_sym(fake, "fake_xla_num_registrations");
    if (!reset || !api || !reg || !last_error || !num) return 2;
    const XLA_FFI_Api* table = (const XLA_FFI_Api*)api();

    reset(-1);
    XlaSsmStatus s = reg(table, "cpu");
    printf("explicit cpu: status=%d registered=%d error=\"%s\"\n", s, num(), last_error());
    print_registrations(fake, lib);
    reset(2);
    s = reg(table, "CUDA");
    printf("explicit refused: status=%d registered=%d error=\"%s\"\n", s, num(), last_error());
    s = reg(table, "TPU");
    printf("explicit tpu: status=%d error=\"%s\"\n", s, last_error());
    s = reg(NULL, "Host");
    printf("explicit null api: status=%d error=\"%s\"\n", s, last_error());
    s = reg(table, NULL);
    printf("explicit null platform: status=%d error=\"%s\"\n", s, last_error());
    printf("done\n");
    return 0;
}
