/* What tests/c/fake_xla.c (a stand-in for a host's XLA) tells the test host about registrations. */
#ifndef FAKE_XLA_H
#define FAKE_XLA_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
    char name[128];
    char platform[32];
    void* execute;
    uint32_t traits;
    /* XLA_FFI_Handler_Register_Args.struct_size as passed. */
    size_t args_struct_size;
    /* What the handler answered in the metadata handshake. */
    int32_t metadata_major, metadata_minor;
    uint32_t metadata_traits;
} Registration;

int fake_xla_num_registrations(void);
const Registration* fake_xla_registration(int i);
/* Forgets every registration; the one with index `refuse_index` (if >= 0) will be refused. */
void fake_xla_reset(int refuse_index);
/* The API table (an XLA_FFI_Api*), as XLA_FFI_GetApi returns it. */
const void* fake_xla_api(void);
#endif
