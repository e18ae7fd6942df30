//! The XLA FFI C API (`xla/ffi/api/c_api.h`), mirrored in `#[repr(C)]`. Only what a handler needs
//! is given real types; the rest of the function table is kept as opaque pointers so the struct
//! layout still matches.
//!
//! Every structure and table entry used here has had the same layout since API 0.1 (jaxlib 0.4.33),
//! so the handlers report 0.1 (see [`HANDLER_API_VERSION`]) and work with every host from jax 0.5.0
//! (the first `jax.ffi`) and EXLA's XLA (0.2) to jaxlib 0.12 (0.5). What later versions changed,
//! none of which this library touches: 0.2 `Type_Register`'s arguments, 0.3 a `stage` in the state
//! entries' arguments, 0.4 a fifth entry (`record`) in the handler bundle, which moves
//! `XLA_FFI_Handler_Register_Args.traits` (hosts still accept the 0.1 layout, told apart by
//! `struct_size`), 0.5 `CustomOptions_Get` appended to the table. `XLA_FFI_CallFrame.future` lies
//! past the frame's `struct_size` in every version and is never touched.
#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_void};

/// The API version the handlers report in the metadata handshake: the oldest whose structures they
/// rely on. Hosts up to jaxlib 0.8.0 accept exactly 0.1; later ones accept 0.1 up to their own.
pub const HANDLER_API_VERSION: (i32, i32) = (0, 1);
/// The only major version there has been; a host with another is refused.
pub const XLA_FFI_API_MAJOR: i32 = 0;

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
}

#[repr(C)]
pub struct XLA_FFI_Metadata_Extension {
    pub extension_base: XLA_FFI_Extension_Base,
    pub metadata: *mut XLA_FFI_Metadata,
}

/// `XLA_FFI_Handler_Bundle` as of API 0.1-0.3 (0.4 appends `record`, which this library does not
/// implement; hosts take the shorter struct, told apart by `XLA_FFI_Handler_Register_Args.struct_size`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct XLA_FFI_Handler_Bundle {
    pub instantiate: Option<XLA_FFI_Handler>,
    pub prepare: Option<XLA_FFI_Handler>,
    pub initialize: Option<XLA_FFI_Handler>,
    pub execute: Option<XLA_FFI_Handler>,
}

#[repr(C)]
pub struct XLA_FFI_Handler_Register_Args {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub name: XLA_FFI_ByteSpan,
    pub platform: XLA_FFI_ByteSpan,
    pub bundle: XLA_FFI_Handler_Bundle,
    pub traits: XLA_FFI_Handler_Traits,
}

pub type XLA_FFI_Error_Create = unsafe extern "C" fn(*mut XLA_FFI_Error_Create_Args) -> *mut XLA_FFI_Error;
pub type XLA_FFI_Error_GetMessage = unsafe extern "C" fn(*mut XLA_FFI_Error_GetMessage_Args);
pub type XLA_FFI_Error_Destroy = unsafe extern "C" fn(*mut XLA_FFI_Error_Destroy_Args);
pub type XLA_FFI_Stream_Get = unsafe extern "C" fn(*mut XLA_FFI_Stream_Get_Args) -> *mut XLA_FFI_Error;
pub type XLA_FFI_Handler_Register = unsafe extern "C" fn(*mut XLA_FFI_Handler_Register_Args) -> *mut XLA_FFI_Error;
/// A function-table entry this library never calls.
pub type Unused = Option<unsafe extern "C" fn()>;

/// The function table XLA passes in every call frame. Field order is the C header's; the entries
/// after `XLA_FFI_Stream_Get` moved between jaxlib 0.4.34 and 0.4.38 and lie past `struct_size`
/// before jaxlib 0.6, so only the first five are ever called.
#[repr(C)]
pub struct XLA_FFI_Api {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub api_version: XLA_FFI_Api_Version,
    pub internal_api: *const c_void,
    pub XLA_FFI_Error_Create: Option<XLA_FFI_Error_Create>,
    pub XLA_FFI_Error_GetMessage: Option<XLA_FFI_Error_GetMessage>,
    pub XLA_FFI_Error_Destroy: Option<XLA_FFI_Error_Destroy>,
    pub XLA_FFI_Handler_Register: Option<XLA_FFI_Handler_Register>,
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
/// 84 on LP64: the API 0.1-0.3 layout, which every host accepts (0.4+ hosts recognise it by size).
pub fn handler_register_args_struct_size() -> usize {
    struct_size!(XLA_FFI_Handler_Register_Args, traits)
}
