//! A fake XLA runtime: an independent `#[repr(C)]` transcription of the parts of XLA's
//! `xla/ffi/api/c_api.h` that a handler touches (deliberately not the library's own mirror in
//! `src/xla/ffi.rs`, so that a layout mistake there shows up here), an `XLA_FFI_Api` table whose error
//! and stream entries are test functions, and builders for call frames laid out the way XLA lays
//! them out (stage EXECUTE, attributes sorted by name).
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_void, CStr, CString};

// ---------------------------------------------------------------------------------------------
// The C ABI, transcribed from xla/ffi/api/c_api.h.

pub const PRED: i32 = 1;
pub const U8: i32 = 6;
pub const S32: i32 = 4;
pub const S64: i32 = 5;
pub const F16: i32 = 10;
pub const F32: i32 = 11;
pub const F64: i32 = 12;
pub const BF16: i32 = 16;

pub const ERR_INVALID_ARGUMENT: i32 = 3;
pub const ERR_UNIMPLEMENTED: i32 = 12;
pub const ERR_INTERNAL: i32 = 13;

pub const STAGE_PREPARE: i32 = 1;
pub const STAGE_EXECUTE: i32 = 3;

const ARG_BUFFER: i32 = 1;
const RET_BUFFER: i32 = 1;
const ATTR_SCALAR: i32 = 3;
const ATTR_STRING: i32 = 4;
const EXTENSION_METADATA: i32 = 1;

#[repr(C)]
pub struct ExtensionBase {
    pub struct_size: usize,
    pub type_: i32,
    pub next: *mut ExtensionBase,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ApiVersion {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub major_version: i32,
    pub minor_version: i32,
}

#[repr(C)]
pub struct ErrorCreateArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub message: *const c_char,
    pub errc: i32,
}

#[repr(C)]
pub struct ErrorGetMessageArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub error: *mut c_void,
    pub message: *const c_char,
}

#[repr(C)]
pub struct ErrorDestroyArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub error: *mut c_void,
}

#[repr(C)]
pub struct StreamGetArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub ctx: *mut c_void,
    pub stream: *mut c_void,
}

#[repr(C)]
pub struct Buffer {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub dtype: i32,
    pub data: *mut c_void,
    pub rank: i64,
    pub dims: *mut i64,
}

#[repr(C)]
pub struct ByteSpan {
    pub ptr: *const c_char,
    pub len: usize,
}

#[repr(C)]
pub struct Scalar {
    pub dtype: i32,
    pub value: *mut c_void,
}

#[repr(C)]
pub struct Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub size: i64,
    pub types: *mut i32,
    pub args: *mut *mut c_void,
}

#[repr(C)]
pub struct Rets {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub size: i64,
    pub types: *mut i32,
    pub rets: *mut *mut c_void,
}

#[repr(C)]
pub struct Attrs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub size: i64,
    pub types: *mut i32,
    pub names: *mut *mut ByteSpan,
    pub attrs: *mut *mut c_void,
}

#[repr(C)]
pub struct CallFrame {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub api: *const Api,
    pub ctx: *mut c_void,
    pub stage: i32,
    pub args: Args,
    pub rets: Rets,
    pub attrs: Attrs,
    pub future: *mut c_void,
}

#[repr(C)]
pub struct Metadata {
    pub struct_size: usize,
    pub api_version: ApiVersion,
    pub traits: u32,
    pub state_type_id: i64,
}

#[repr(C)]
pub struct MetadataExtension {
    pub extension_base: ExtensionBase,
    pub metadata: *mut Metadata,
}

type Fn = Option<unsafe extern "C" fn()>;

#[repr(C)]
pub struct Api {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub api_version: ApiVersion,
    pub internal_api: *mut c_void,
    pub error_create: Option<unsafe extern "C" fn(*mut ErrorCreateArgs) -> *mut c_void>,
    pub error_get_message: Option<unsafe extern "C" fn(*mut ErrorGetMessageArgs)>,
    pub error_destroy: Option<unsafe extern "C" fn(*mut ErrorDestroyArgs)>,
    pub handler_register: Fn,
    pub stream_get: Option<unsafe extern "C" fn(*mut StreamGetArgs) -> *mut c_void>,
    pub type_register: Fn,
    pub execution_context_get: Fn,
    pub state_set: Fn,
    pub state_get: Fn,
    pub device_memory_allocate: Fn,
    pub device_memory_free: Fn,
    pub thread_pool_schedule: Fn,
    pub thread_pool_num_threads: Fn,
    pub future_create: Fn,
    pub future_set_available: Fn,
    pub future_set_error: Fn,
    pub run_id_get: Fn,
    pub device_ordinal_get: Fn,
}

// `XLA_FFI_<T>_STRUCT_SIZE` = offsetof(last field) + sizeof(last field), worked out by hand for LP64
// from the C header (so they do not depend on the Rust structs above being right).
pub const CALL_FRAME_STRUCT_SIZE: usize = 168; // ..attrs (8+8+8+8+4+pad4 + args 40 + rets 40 + attrs 48)
pub const BUFFER_STRUCT_SIZE: usize = 48; // ..dims
pub const ARGS_STRUCT_SIZE: usize = 40; // ..args
pub const RETS_STRUCT_SIZE: usize = 40; // ..rets
pub const ATTRS_STRUCT_SIZE: usize = 48; // ..attrs
pub const API_VERSION_STRUCT_SIZE: usize = 24; // ..minor_version
pub const METADATA_STRUCT_SIZE_V1: usize = 36; // ..traits (API 0.1: no state_type_id)
pub const METADATA_STRUCT_SIZE: usize = 48; // ..state_type_id (API 0.3)
pub const METADATA_EXTENSION_STRUCT_SIZE: usize = 32; // ..metadata
pub const STREAM_GET_ARGS_STRUCT_SIZE: usize = 32; // ..stream

// The transcription above must have the C header's layout.
const _: () = {
    assert!(std::mem::size_of::<CallFrame>() == CALL_FRAME_STRUCT_SIZE + 8);
    assert!(std::mem::offset_of!(CallFrame, stage) == 32);
    assert!(std::mem::offset_of!(CallFrame, args) == 40);
    assert!(std::mem::offset_of!(CallFrame, rets) == 80);
    assert!(std::mem::offset_of!(CallFrame, attrs) == 120);
    assert!(std::mem::size_of::<Buffer>() == BUFFER_STRUCT_SIZE);
    assert!(std::mem::offset_of!(Buffer, data) == 24);
    assert!(std::mem::size_of::<Args>() == ARGS_STRUCT_SIZE);
    assert!(std::mem::size_of::<Attrs>() == ATTRS_STRUCT_SIZE);
    assert!(std::mem::size_of::<ApiVersion>() == API_VERSION_STRUCT_SIZE);
    assert!(std::mem::offset_of!(Metadata, traits) == 32);
    assert!(std::mem::size_of::<Metadata>() == METADATA_STRUCT_SIZE);
    assert!(std::mem::size_of::<MetadataExtension>() == METADATA_EXTENSION_STRUCT_SIZE);
    assert!(std::mem::offset_of!(Api, error_create) == 48);
    assert!(std::mem::offset_of!(Api, stream_get) == 80);
    assert!(std::mem::size_of::<Scalar>() == 16);
    assert!(std::mem::size_of::<ByteSpan>() == 16);
};

// ---------------------------------------------------------------------------------------------
// The fake runtime.

/// What `XLA_FFI_Error_Create` hands out: the code and the message (the handler's bytes, copied).
struct FakeError {
    code: i32,
    message: CString,
}

unsafe extern "C" fn error_create(args: *mut ErrorCreateArgs) -> *mut c_void {
    let args = &*args;
    let message = if args.message.is_null() { CString::default() } else { CStr::from_ptr(args.message).to_owned() };
    Box::into_raw(Box::new(FakeError { code: args.errc, message })) as *mut c_void
}

unsafe extern "C" fn error_get_message(args: *mut ErrorGetMessageArgs) {
    let args = &mut *args;
    args.message = (*(args.error as *const FakeError)).message.as_ptr();
}

unsafe extern "C" fn error_destroy(args: *mut ErrorDestroyArgs) {
    drop(Box::from_raw((*args).error as *mut FakeError));
}

/// What the frame's `ctx` points at: the stream `XLA_FFI_Stream_Get` returns, or an error.
#[repr(C)]
pub struct FakeContext {
    pub stream: *mut c_void,
    pub fail_stream_get: bool,
}

unsafe extern "C" fn stream_get(args: *mut StreamGetArgs) -> *mut c_void {
    let args = &mut *args;
    let ctx = &*(args.ctx as *const FakeContext);
    if ctx.fail_stream_get {
        let msg = CString::new("fake runtime: no stream for you").unwrap();
        let mut create = ErrorCreateArgs {
            struct_size: 32,
            extension_start: std::ptr::null_mut(),
            message: msg.as_ptr(),
            errc: ERR_INTERNAL,
        };
        return error_create(&mut create);
    }
    args.stream = ctx.stream;
    std::ptr::null_mut()
}

/// The API table of the fake runtime (version 0.3, full size).
pub fn api() -> Api {
    Api {
        struct_size: std::mem::size_of::<Api>(),
        extension_start: std::ptr::null_mut(),
        api_version: ApiVersion {
            struct_size: API_VERSION_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            major_version: 0,
            minor_version: 3,
        },
        internal_api: std::ptr::null_mut(),
        error_create: Some(error_create),
        error_get_message: Some(error_get_message),
        error_destroy: Some(error_destroy),
        handler_register: None,
        stream_get: Some(stream_get),
        type_register: None,
        execution_context_get: None,
        state_set: None,
        state_get: None,
        device_memory_allocate: None,
        device_memory_free: None,
        thread_pool_schedule: None,
        thread_pool_num_threads: None,
        future_create: None,
        future_set_available: None,
        future_set_error: None,
        run_id_get: None,
        device_ordinal_get: None,
    }
}

/// An operand or result: dtype code, dims and a data pointer (host or device memory, owned elsewhere).
#[derive(Clone, Debug)]
pub struct Buf {
    pub dtype: i32,
    pub dims: Vec<i64>,
    pub data: *mut c_void,
}

/// An attribute value.
#[derive(Clone, Debug)]
pub enum Attr {
    /// A PRED scalar (what `jax.ffi.ffi_call` makes of a Python bool).
    Bool(bool),
    /// A string (byte span, not NUL-terminated).
    Str(String),
    /// A scalar of any dtype, given by its bytes.
    Scalar(i32, Vec<u8>),
}

/// Everything a call frame points at, owned, at stable addresses. Build with [`Frame::new`], tweak
/// the public `raw` frame if a test needs to, pass [`Frame::ptr`] to a handler.
// The boxes are what keeps addresses stable while the vectors holding them grow.
#[allow(clippy::vec_box)]
pub struct Frame {
    pub raw: Box<CallFrame>,
    pub api: Box<Api>,
    pub ctx: Box<FakeContext>,
    _dims: Vec<Vec<i64>>,
    _buffers: Vec<Box<Buffer>>,
    _arg_types: Vec<i32>,
    _arg_ptrs: Vec<*mut c_void>,
    _ret_types: Vec<i32>,
    _ret_ptrs: Vec<*mut c_void>,
    _attr_types: Vec<i32>,
    _attr_names: Vec<Box<ByteSpan>>,
    _attr_name_ptrs: Vec<*mut ByteSpan>,
    _attr_ptrs: Vec<*mut c_void>,
    _attr_bytes: Vec<Vec<u8>>,
    _attr_words: Vec<Vec<u64>>,
    _attr_spans: Vec<Box<ByteSpan>>,
    _attr_scalars: Vec<Box<Scalar>>,
}

impl Frame {
    /// A frame at stage EXECUTE on the fake runtime, with `stream` behind its context. Attributes
    /// are sorted by name, as XLA sorts them.
    pub fn new(args: &[Buf], rets: &[Buf], attrs: &[(&str, Attr)], stream: *mut c_void) -> Frame {
        let api = Box::new(api());
        let mut ctx = Box::new(FakeContext { stream, fail_stream_get: false });
        let mut dims: Vec<Vec<i64>> = Vec::new();
        let mut buffers: Vec<Box<Buffer>> = Vec::new();
        let mut make = |b: &Buf| -> *mut c_void {
            let mut d = b.dims.clone();
            let dims_ptr = d.as_mut_ptr();
            dims.push(d);
            let mut buf = Box::new(Buffer {
                struct_size: BUFFER_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                dtype: b.dtype,
                data: b.data,
                rank: b.dims.len() as i64,
                dims: dims_ptr,
            });
            let p = &mut *buf as *mut Buffer as *mut c_void;
            buffers.push(buf);
            p
        };
        let mut arg_ptrs: Vec<*mut c_void> = args.iter().map(&mut make).collect();
        let mut ret_ptrs: Vec<*mut c_void> = rets.iter().map(&mut make).collect();
        let mut arg_types = vec![ARG_BUFFER; args.len()];
        let mut ret_types = vec![RET_BUFFER; rets.len()];

        let mut sorted: Vec<&(&str, Attr)> = attrs.iter().collect();
        sorted.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        let mut attr_bytes: Vec<Vec<u8>> = Vec::new();
        let mut attr_words: Vec<Vec<u64>> = Vec::new();
        let mut attr_types = Vec::new();
        let mut attr_names = Vec::new();
        let mut attr_spans = Vec::new();
        let mut attr_scalars = Vec::new();
        let mut attr_ptrs = Vec::new();
        for (name, value) in sorted {
            let name_bytes = name.as_bytes().to_vec();
            attr_names.push(Box::new(ByteSpan { ptr: name_bytes.as_ptr() as *const c_char, len: name_bytes.len() }));
            attr_bytes.push(name_bytes);
            match value {
                Attr::Str(s) => {
                    let bytes = s.as_bytes().to_vec();
                    let mut span = Box::new(ByteSpan { ptr: bytes.as_ptr() as *const c_char, len: bytes.len() });
                    attr_ptrs.push(&mut *span as *mut ByteSpan as *mut c_void);
                    attr_spans.push(span);
                    attr_bytes.push(bytes);
                    attr_types.push(ATTR_STRING);
                }
                Attr::Bool(v) => {
                    let mut bytes = vec![*v as u8];
                    let mut scalar = Box::new(Scalar { dtype: PRED, value: bytes.as_mut_ptr() as *mut c_void });
                    attr_ptrs.push(&mut *scalar as *mut Scalar as *mut c_void);
                    attr_scalars.push(scalar);
                    attr_bytes.push(bytes);
                    attr_types.push(ATTR_SCALAR);
                }
                Attr::Scalar(dtype, raw) => {
                    // An 8-byte aligned copy of the value.
                    let mut words = vec![0u64; raw.len().div_ceil(8).max(1)];
                    // SAFETY: `words` holds at least raw.len() bytes.
                    unsafe { std::ptr::copy_nonoverlapping(raw.as_ptr(), words.as_mut_ptr() as *mut u8, raw.len()) };
                    let mut scalar = Box::new(Scalar { dtype: *dtype, value: words.as_mut_ptr() as *mut c_void });
                    attr_ptrs.push(&mut *scalar as *mut Scalar as *mut c_void);
                    attr_scalars.push(scalar);
                    attr_words.push(words);
                    attr_types.push(ATTR_SCALAR);
                }
            }
        }
        let mut attr_name_ptrs: Vec<*mut ByteSpan> =
            attr_names.iter_mut().map(|s: &mut Box<ByteSpan>| &mut **s as *mut ByteSpan).collect();

        let raw = Box::new(CallFrame {
            struct_size: CALL_FRAME_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            api: &*api as *const Api,
            ctx: &mut *ctx as *mut FakeContext as *mut c_void,
            stage: STAGE_EXECUTE,
            args: Args {
                struct_size: ARGS_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                size: args.len() as i64,
                types: arg_types.as_mut_ptr(),
                args: arg_ptrs.as_mut_ptr(),
            },
            rets: Rets {
                struct_size: RETS_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                size: rets.len() as i64,
                types: ret_types.as_mut_ptr(),
                rets: ret_ptrs.as_mut_ptr(),
            },
            attrs: Attrs {
                struct_size: ATTRS_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                size: attr_types.len() as i64,
                types: attr_types.as_mut_ptr(),
                names: attr_name_ptrs.as_mut_ptr(),
                attrs: attr_ptrs.as_mut_ptr(),
            },
            future: std::ptr::null_mut(),
        });
        Frame {
            raw,
            api,
            ctx,
            _dims: dims,
            _buffers: buffers,
            _arg_types: arg_types,
            _arg_ptrs: arg_ptrs,
            _ret_types: ret_types,
            _ret_ptrs: ret_ptrs,
            _attr_types: attr_types,
            _attr_names: attr_names,
            _attr_name_ptrs: attr_name_ptrs,
            _attr_ptrs: attr_ptrs,
            _attr_bytes: attr_bytes,
            _attr_words: attr_words,
            _attr_spans: attr_spans,
            _attr_scalars: attr_scalars,
        }
    }

    pub fn ptr(&mut self) -> *mut CallFrame {
        &mut *self.raw
    }
}

/// The exported handlers' type (as the library declares it).
pub type Handler = xla_ssm::xla::ffi::XLA_FFI_Handler;

/// Reads and destroys an error a handler returned, as XLA does: `Err((code, message))`; a null error is `Ok`.
///
/// # Safety
/// `err` is null or was made by this fake runtime's `error_create`.
pub unsafe fn take_error(api: &Api, err: *mut c_void) -> Result<(), (i32, String)> {
    if err.is_null() {
        return Ok(());
    }
    let code = (*(err as *const FakeError)).code;
    let mut get = ErrorGetMessageArgs {
        struct_size: 32,
        extension_start: std::ptr::null_mut(),
        error: err,
        message: std::ptr::null(),
    };
    (api.error_get_message.unwrap())(&mut get);
    let message = CStr::from_ptr(get.message).to_string_lossy().into_owned();
    let mut destroy = ErrorDestroyArgs { struct_size: 24, extension_start: std::ptr::null_mut(), error: err };
    (api.error_destroy.unwrap())(&mut destroy);
    Err((code, message))
}

/// Calls `handler` on `frame`: `Ok(())` or `Err((code, message))`.
pub fn call(handler: Handler, frame: &mut Frame) -> Result<(), (i32, String)> {
    // SAFETY: the frame is laid out as the C header says and owns everything it points at.
    unsafe {
        let err = handler(frame.ptr() as *mut xla_ssm::xla::ffi::XLA_FFI_CallFrame);
        take_error(&frame.api, err as *mut c_void)
    }
}

/// What the metadata handshake reported.
#[derive(Debug, Clone, Copy)]
pub struct MetadataReply {
    pub major: i32,
    pub minor: i32,
    pub api_version_struct_size: usize,
    pub traits: u32,
    pub state_type_id: i64,
}

/// Calls `handler` the way XLA asks for its metadata at registration: a call frame carrying only
/// its size and an `XLA_FFI_Metadata_Extension` (no API table, unless `with_api`), with a metadata
/// struct of `metadata_struct_size` bytes (the fields past it are left as sentinels).
pub fn call_metadata(
    handler: Handler,
    metadata_struct_size: usize,
    with_api: bool,
) -> Result<MetadataReply, (i32, String)> {
    let api = api();
    let mut metadata = Metadata {
        struct_size: metadata_struct_size,
        api_version: ApiVersion {
            struct_size: API_VERSION_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            major_version: -1,
            minor_version: -1,
        },
        traits: 0xdead,
        state_type_id: -7,
    };
    let mut ext = MetadataExtension {
        extension_base: ExtensionBase {
            struct_size: METADATA_EXTENSION_STRUCT_SIZE,
            type_: EXTENSION_METADATA,
            next: std::ptr::null_mut(),
        },
        metadata: &mut metadata,
    };
    // SAFETY: all-zero is a valid CallFrame (null pointers, zero sizes).
    let mut frame: CallFrame = unsafe { std::mem::zeroed() };
    frame.struct_size = CALL_FRAME_STRUCT_SIZE;
    frame.extension_start = &mut ext.extension_base;
    if with_api {
        frame.api = &api;
    }
    // SAFETY: as XLA builds it.
    let result = unsafe {
        let err = handler(&mut frame as *mut CallFrame as *mut xla_ssm::xla::ffi::XLA_FFI_CallFrame);
        take_error(&api, err as *mut c_void)
    };
    result.map(|()| MetadataReply {
        major: metadata.api_version.major_version,
        minor: metadata.api_version.minor_version,
        api_version_struct_size: metadata.api_version.struct_size,
        traits: metadata.traits,
        state_type_id: metadata.state_type_id,
    })
}
