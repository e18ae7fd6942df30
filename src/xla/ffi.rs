//! The XLA FFI C API (`xla/ffi/api/c_api.h`, API version 0.3 as shipped in jaxlib), mirrored in
//! `#[repr(C)]`. Only what a handler needs is given real types; the rest of the function table is
//! kept as opaque pointers so the struct layout still matches.
#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_void};

/// The FFI API version this library is written against.
pub const XLA_FFI_API_MAJOR: i32 = 0;
pub const XLA_FFI_API_MINOR: i32 = 3;

/// `offsetof(T, last_field) + sizeof(last_field)`, the C header's `XLA_FFI_STRUCT_SIZE`.
macro_rules! struct_size {
    ($t:ty, $field:ident) => {{
        let uninit = std::mem::MaybeUninit::<$t>::uninit();
        let base = uninit.as_ptr();
        // SAFETY: only the address of the field is taken, nothing is read.
        let field = unsafe { std::ptr::addr_of!((*base).$field) };
        (field as usize - base as usize) + std::mem::size_of_val(unsafe { &*field })
    }};
}
pub(crate) use struct_size;

pub type XLA_FFI_Extension_Type = i32;
pub const XLA_FFI_EXTENSION_METADATA: XLA_FFI_Extension_Type = 1;

#[repr(C)]
pub struct XLA_FFI_Extension_Base {
    pub struct_size: usize,
    pub type_: XLA_FFI_Extension_Type,
    pub next: *mut XLA_FFI_Extension_Base,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct XLA_FFI_Api_Version {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub major_version: i32,
    pub minor_version: i32,
}

/// Opaque error object owned by XLA.
#[repr(C)]
pub struct XLA_FFI_Error {
    _private: [u8; 0],
}

pub type XLA_FFI_Error_Code = i32;
pub const XLA_FFI_ERROR_CODE_OK: XLA_FFI_Error_Code = 0;
pub const XLA_FFI_ERROR_CODE_INVALID_ARGUMENT: XLA_FFI_Error_Code = 3;
pub const XLA_FFI_ERROR_CODE_FAILED_PRECONDITION: XLA_FFI_Error_Code = 9;
pub const XLA_FFI_ERROR_CODE_UNIMPLEMENTED: XLA_FFI_Error_Code = 12;
pub const XLA_FFI_ERROR_CODE_INTERNAL: XLA_FFI_Error_Code = 13;

#[repr(C)]
pub struct XLA_FFI_Error_Create_Args {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub message: *const c_char,
    pub errc: XLA_FFI_Error_Code,
}

#[repr(C)]
pub struct XLA_FFI_Error_GetMessage_Args {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub error: *mut XLA_FFI_Error,
    pub message: *const c_char,
}

#[repr(C)]
pub struct XLA_FFI_Error_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub error: *mut XLA_FFI_Error,
}

/// `XLA_FFI_DataType` codes (the subset this library names; others are carried as raw values).
pub type XLA_FFI_DataType = i32;
pub const XLA_FFI_DATA_TYPE_PRED: XLA_FFI_DataType = 1;
pub const XLA_FFI_DATA_TYPE_S8: XLA_FFI_DataType = 2;
pub const XLA_FFI_DATA_TYPE_S16: XLA_FFI_DataType = 3;
pub const XLA_FFI_DATA_TYPE_S32: XLA_FFI_DataType = 4;
pub const XLA_FFI_DATA_TYPE_S64: XLA_FFI_DataType = 5;
pub const XLA_FFI_DATA_TYPE_U8: XLA_FFI_DataType = 6;
pub const XLA_FFI_DATA_TYPE_F16: XLA_FFI_DataType = 10;
pub const XLA_FFI_DATA_TYPE_F32: XLA_FFI_DataType = 11;
pub const XLA_FFI_DATA_TYPE_F64: XLA_FFI_DataType = 12;
pub const XLA_FFI_DATA_TYPE_BF16: XLA_FFI_DataType = 16;

#[repr(C)]
pub struct XLA_FFI_Buffer {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub dtype: XLA_FFI_DataType,
    pub data: *mut c_void,
    pub rank: i64,
    pub dims: *mut i64,
}

pub type XLA_FFI_ArgType = i32;
pub const XLA_FFI_ARG_TYPE_BUFFER: XLA_FFI_ArgType = 1;
pub type XLA_FFI_RetType = i32;
pub const XLA_FFI_RET_TYPE_BUFFER: XLA_FFI_RetType = 1;

pub type XLA_FFI_AttrType = i32;
pub const XLA_FFI_ATTR_TYPE_ARRAY: XLA_FFI_AttrType = 1;
pub const XLA_FFI_ATTR_TYPE_DICTIONARY: XLA_FFI_AttrType = 2;
pub const XLA_FFI_ATTR_TYPE_SCALAR: XLA_FFI_AttrType = 3;
pub const XLA_FFI_ATTR_TYPE_STRING: XLA_FFI_AttrType = 4;

#[repr(C)]
pub struct XLA_FFI_ExecutionContext {
    _private: [u8; 0],
}

#[repr(C)]
pub struct XLA_FFI_ByteSpan {
    pub ptr: *const c_char,
    pub len: usize,
}

#[repr(C)]
pub struct XLA_FFI_Scalar {
    pub dtype: XLA_FFI_DataType,
    pub value: *mut c_void,
}

#[repr(C)]
pub struct XLA_FFI_Array {
    pub dtype: XLA_FFI_DataType,
    pub size: usize,
    pub data: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XLA_FFI_TypeId {
    pub type_id: i64,
}

pub type XLA_FFI_ExecutionStage = i32;
pub const XLA_FFI_EXECUTION_STAGE_INSTANTIATE: XLA_FFI_ExecutionStage = 0;
pub const XLA_FFI_EXECUTION_STAGE_PREPARE: XLA_FFI_ExecutionStage = 1;
pub const XLA_FFI_EXECUTION_STAGE_INITIALIZE: XLA_FFI_ExecutionStage = 2;
pub const XLA_FFI_EXECUTION_STAGE_EXECUTE: XLA_FFI_ExecutionStage = 3;

#[repr(C)]
pub struct XLA_FFI_Args {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub size: i64,
    pub types: *mut XLA_FFI_ArgType,
    pub args: *mut *mut c_void,
}

#[repr(C)]
pub struct XLA_FFI_Rets {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub size: i64,
    pub types: *mut XLA_FFI_RetType,
    pub rets: *mut *mut c_void,
}

#[repr(C)]
pub struct XLA_FFI_Attrs {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub size: i64,
    pub types: *mut XLA_FFI_AttrType,
    pub names: *mut *mut XLA_FFI_ByteSpan,
    pub attrs: *mut *mut c_void,
}

/// Opaque future (asynchronous handlers); this library's handlers are synchronous.
#[repr(C)]
pub struct XLA_FFI_Future {
    _private: [u8; 0],
}

#[repr(C)]
pub struct XLA_FFI_CallFrame {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub api: *const XLA_FFI_Api,
    pub ctx: *mut XLA_FFI_ExecutionContext,
    pub stage: XLA_FFI_ExecutionStage,
    pub args: XLA_FFI_Args,
    pub rets: XLA_FFI_Rets,
    pub attrs: XLA_FFI_Attrs,
    pub future: *mut XLA_FFI_Future,
}

pub type XLA_FFI_Handler_Traits = u32;
pub const XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE: XLA_FFI_Handler_Traits = 1;

#[repr(C)]
pub struct XLA_FFI_Stream_Get_Args {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub ctx: *mut XLA_FFI_ExecutionContext,
    pub stream: *mut c_void,
}

#[repr(C)]
pub struct XLA_FFI_Metadata {
    pub struct_size: usize,
    pub api_version: XLA_FFI_Api_Version,
    pub traits: XLA_FFI_Handler_Traits,
    pub state_type_id: XLA_FFI_TypeId,
}

#[repr(C)]
pub struct XLA_FFI_Metadata_Extension {
    pub extension_base: XLA_FFI_Extension_Base,
    pub metadata: *mut XLA_FFI_Metadata,
}

pub type XLA_FFI_Error_Create = unsafe extern "C" fn(*mut XLA_FFI_Error_Create_Args) -> *mut XLA_FFI_Error;
pub type XLA_FFI_Error_GetMessage = unsafe extern "C" fn(*mut XLA_FFI_Error_GetMessage_Args);
pub type XLA_FFI_Error_Destroy = unsafe extern "C" fn(*mut XLA_FFI_Error_Destroy_Args);
pub type XLA_FFI_Stream_Get = unsafe extern "C" fn(*mut XLA_FFI_Stream_Get_Args) -> *mut XLA_FFI_Error;
/// A function-table entry this library never calls.
pub type Unused = Option<unsafe extern "C" fn()>;

/// The function table XLA passes in every call frame. Field order is the C header's.
#[repr(C)]
pub struct XLA_FFI_Api {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub api_version: XLA_FFI_Api_Version,
    pub internal_api: *const c_void,
    pub XLA_FFI_Error_Create: Option<XLA_FFI_Error_Create>,
    pub XLA_FFI_Error_GetMessage: Option<XLA_FFI_Error_GetMessage>,
    pub XLA_FFI_Error_Destroy: Option<XLA_FFI_Error_Destroy>,
    pub XLA_FFI_Handler_Register: Unused,
    pub XLA_FFI_Stream_Get: Option<XLA_FFI_Stream_Get>,
    pub XLA_FFI_Type_Register: Unused,
    pub XLA_FFI_ExecutionContext_Get: Unused,
    pub XLA_FFI_State_Set: Unused,
    pub XLA_FFI_State_Get: Unused,
    pub XLA_FFI_DeviceMemory_Allocate: Unused,
    pub XLA_FFI_DeviceMemory_Free: Unused,
    pub XLA_FFI_ThreadPool_Schedule: Unused,
    pub XLA_FFI_ThreadPool_NumThreads: Unused,
    pub XLA_FFI_Future_Create: Unused,
    pub XLA_FFI_Future_SetAvailable: Unused,
    pub XLA_FFI_Future_SetError: Unused,
    pub XLA_FFI_RunId_Get: Unused,
    pub XLA_FFI_DeviceOrdinal_Get: Unused,
}

/// The signature of an exported handler.
pub type XLA_FFI_Handler = unsafe extern "C" fn(*mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error;

/// `XLA_FFI_*_STRUCT_SIZE` of the C header, for the structs whose sizes are checked.
pub fn call_frame_struct_size() -> usize {
    struct_size!(XLA_FFI_CallFrame, attrs)
}
pub fn api_struct_size_min() -> usize {
    // Every entry this library calls must be present.
    struct_size!(XLA_FFI_Api, XLA_FFI_Stream_Get)
}
pub fn buffer_struct_size() -> usize {
    struct_size!(XLA_FFI_Buffer, dims)
}
pub fn metadata_struct_size() -> usize {
    struct_size!(XLA_FFI_Metadata, traits)
}
pub fn metadata_extension_struct_size() -> usize {
    struct_size!(XLA_FFI_Metadata_Extension, metadata)
}
pub fn api_version_struct_size() -> usize {
    struct_size!(XLA_FFI_Api_Version, minor_version)
}
pub fn error_create_args_struct_size() -> usize {
    struct_size!(XLA_FFI_Error_Create_Args, errc)
}
pub fn stream_get_args_struct_size() -> usize {
    struct_size!(XLA_FFI_Stream_Get_Args, stream)
}
