//! Decoding an `XLA_FFI_CallFrame`: operands, results, attributes and the CUDA stream, each checked,
//! and errors turned into `XLA_FFI_Error`s.

use super::ffi::*;
use crate::error::{Error, Result};
use crate::ops::Tensor;
use crate::DType;
use std::ffi::{c_void, CString};

/// A call frame whose struct sizes and API version were checked (see [`Frame::new`]).
pub struct Frame<'a> {
    raw: &'a XLA_FFI_CallFrame,
    api: &'a XLA_FFI_Api,
}

/// What the handler should do with a call frame.
pub enum Call<'a> {
    /// XLA asks for the handler's metadata (at registration).
    Metadata(&'a mut XLA_FFI_Metadata_Extension),
    /// Run at this stage.
    Run(Frame<'a>),
}

impl<'a> Call<'a> {
    /// Checks the frame against the C API this library mirrors and says what it asks for.
    ///
    /// # Safety
    /// `raw` must be a call frame handed over by XLA (or a host that builds frames the same way).
    pub unsafe fn decode(raw: &'a mut XLA_FFI_CallFrame) -> std::result::Result<Call<'a>, String> {
        if raw.struct_size < call_frame_struct_size() {
            return Err(format!(
                "unexpected XLA_FFI_CallFrame size: expected at least {}, got {}; check installed software versions",
                call_frame_struct_size(),
                raw.struct_size
            ));
        }
        if !raw.extension_start.is_null() && (*raw.extension_start).type_ == XLA_FFI_EXTENSION_METADATA {
            let ext = &mut *(raw.extension_start as *mut XLA_FFI_Metadata_Extension);
            if ext.extension_base.struct_size < metadata_extension_struct_size()
                || ext.metadata.is_null()
                || (*ext.metadata).struct_size < metadata_struct_size()
            {
                return Err("unexpected XLA_FFI_Metadata size; check installed software versions".into());
            }
            return Ok(Call::Metadata(ext));
        }
        let Some(api) = raw.api.as_ref() else {
            return Err("the call frame has no XLA_FFI_Api table".into());
        };
        if api.struct_size < api_struct_size_min() {
            return Err(format!(
                "unexpected XLA_FFI_Api size: expected at least {}, got {}; check installed software versions",
                api_struct_size_min(),
                api.struct_size
            ));
        }
        if api.api_version.major_version != XLA_FFI_API_MAJOR {
            return Err(format!(
                "XLA FFI API version {}.{} is not supported: this library speaks {}.x (from {}.{})",
                api.api_version.major_version,
                api.api_version.minor_version,
                XLA_FFI_API_MAJOR,
                HANDLER_API_VERSION.0,
                HANDLER_API_VERSION.1
            ));
        }
        check_arrays("operands", raw.args.size, &[raw.args.types as *const c_void, raw.args.args as *const c_void])?;
        check_arrays("results", raw.rets.size, &[raw.rets.types as *const c_void, raw.rets.rets as *const c_void])?;
        let attrs = &raw.attrs;
        check_arrays(
            "attributes",
            attrs.size,
            &[attrs.types as *const c_void, attrs.names as *const c_void, attrs.attrs as *const c_void],
        )?;
        Ok(Call::Run(Frame { raw, api }))
    }
}

/// A frame's list of `size` entries is usable: no negative size, no missing array.
fn check_arrays(what: &str, size: i64, arrays: &[*const c_void]) -> std::result::Result<(), String> {
    if size < 0 {
        return Err(format!("the call frame has a negative number of {what} ({size})"));
    }
    if size > 0 && arrays.iter().any(|a| a.is_null()) {
        return Err(format!("the call frame has {size} {what} but a null array of them"));
    }
    Ok(())
}

/// The bytes of a span, or None when the span or its data is missing.
///
/// # Safety
/// `span` is null or points at a byte span whose `ptr` addresses `len` bytes (or is null).
unsafe fn byte_span<'b>(span: *const XLA_FFI_ByteSpan) -> Option<&'b [u8]> {
    let span = span.as_ref()?;
    match (span.ptr.is_null(), span.len) {
        (_, 0) => Some(&[]),
        (true, _) => None,
        (false, len) => Some(std::slice::from_raw_parts(span.ptr as *const u8, len)),
    }
}

/// The highest rank a buffer may have (every operand of the library has at most 5 dimensions).
const MAX_RANK: i64 = 8;

impl<'a> Frame<'a> {
    pub fn stage(&self) -> XLA_FFI_ExecutionStage {
        self.raw.stage
    }

    pub fn api(&self) -> &'a XLA_FFI_Api {
        self.api
    }

    pub fn num_args(&self) -> usize {
        self.raw.args.size.max(0) as usize
    }

    pub fn num_rets(&self) -> usize {
        self.raw.rets.size.max(0) as usize
    }

    /// Operand `index`, named `name` in errors.
    pub fn arg(&self, index: usize, name: &str) -> Result<Tensor> {
        let args = &self.raw.args;
        if index >= self.num_args() {
            return Err(Error::invalid(format!(
                "operand {index} (`{name}`) is missing: the call has {} operands",
                self.num_args()
            )));
        }
        // SAFETY: index < size, and XLA sizes both arrays `size`.
        unsafe {
            if *args.types.add(index) != XLA_FFI_ARG_TYPE_BUFFER {
                return Err(Error::invalid(format!("operand {index} (`{name}`) is not a buffer")));
            }
            buffer_to_tensor(*args.args.add(index) as *const XLA_FFI_Buffer, "operand", index, name)
        }
    }

    /// Result `index`, named `name` in errors.
    pub fn ret(&self, index: usize, name: &str) -> Result<Tensor> {
        let rets = &self.raw.rets;
        if index >= self.num_rets() {
            return Err(Error::invalid(format!(
                "result {index} (`{name}`) is missing: the call has {} results",
                self.num_rets()
            )));
        }
        // SAFETY: as in `arg`.
        unsafe {
            if *rets.types.add(index) != XLA_FFI_RET_TYPE_BUFFER {
                return Err(Error::invalid(format!("result {index} (`{name}`) is not a buffer")));
            }
            buffer_to_tensor(*rets.rets.add(index) as *const XLA_FFI_Buffer, "result", index, name)
        }
    }

    /// The attribute called `name`, as (type, pointer), or an error naming it when absent.
    fn attr(&self, name: &str) -> Result<(XLA_FFI_AttrType, *mut c_void)> {
        self.lookup(name).map_err(|names| {
            Error::invalid(format!("attribute `{name}` is missing (the call has: [{}])", names.join(", ")))
        })
    }

    /// The call's attributes: (name, type, value).
    fn attrs(&self) -> impl Iterator<Item = (&'a [u8], XLA_FFI_AttrType, *mut c_void)> + '_ {
        let attrs = &self.raw.attrs;
        (0..attrs.size.max(0) as usize).map(move |i| {
            // SAFETY: i < size; `decode` checked that the three arrays exist, and XLA sizes them
            // alike; names are byte spans.
            unsafe { (byte_span(*attrs.names.add(i)).unwrap_or_default(), *attrs.types.add(i), *attrs.attrs.add(i)) }
        })
    }

    /// The names of the call's attributes.
    pub fn attr_names(&self) -> Vec<String> {
        self.attrs().map(|(key, _, _)| String::from_utf8_lossy(key).into_owned()).collect()
    }

    /// The attribute called `name`, or the names of those the call has.
    fn lookup(&self, name: &str) -> std::result::Result<(XLA_FFI_AttrType, *mut c_void), Vec<String>> {
        match self.attrs().find(|(key, _, _)| *key == name.as_bytes()) {
            Some((_, ty, value)) => Ok((ty, value)),
            None => Err(self.attr_names()),
        }
    }

    /// An optional attribute: `read` (e.g. [`Frame::attr_i64`]) when the call has it, else `None`.
    pub fn attr_opt<T>(&self, name: &str, read: impl Fn(&Self, &str) -> Result<T>) -> Result<Option<T>> {
        match self.lookup(name) {
            Ok(_) => read(self, name).map(Some),
            Err(_) => Ok(None),
        }
    }

    /// The scalar attribute `name` (`kind` names what is expected, in errors), with its value's
    /// address checked.
    fn scalar(&self, name: &str, kind: &str) -> Result<(XLA_FFI_DataType, *const c_void)> {
        let (ty, value) = self.attr(name)?;
        if ty != XLA_FFI_ATTR_TYPE_SCALAR {
            return Err(Error::invalid(format!("attribute `{name}`: expected {kind}, got {}", attr_type_name(ty))));
        }
        // SAFETY: a scalar attribute's entry is null or points at an XLA_FFI_Scalar.
        match unsafe { (value as *const XLA_FFI_Scalar).as_ref() } {
            Some(scalar) if !scalar.value.is_null() => Ok((scalar.dtype, scalar.value)),
            _ => Err(Error::invalid(format!("attribute `{name}`: the scalar has no value"))),
        }
    }

    /// An integer attribute (a signed integer scalar of any width; `jax.ffi.ffi_call` makes Python
    /// ints i64 and NumPy ones their own width).
    pub fn attr_i64(&self, name: &str) -> Result<i64> {
        let (dtype, v) = self.scalar(name, "an integer scalar")?;
        // SAFETY: the value has its dtype's size (alignment is not promised: read unaligned).
        unsafe {
            match dtype {
                XLA_FFI_DATA_TYPE_S8 => Ok((v as *const i8).read() as i64),
                XLA_FFI_DATA_TYPE_S16 => Ok((v as *const i16).read_unaligned() as i64),
                XLA_FFI_DATA_TYPE_S32 => Ok((v as *const i32).read_unaligned() as i64),
                XLA_FFI_DATA_TYPE_S64 => Ok((v as *const i64).read_unaligned()),
                other => Err(Error::invalid(format!(
                    "attribute `{name}`: expected an integer scalar, got a {} scalar",
                    dtype_from_xla(other).name()
                ))),
            }
        }
    }

    /// A boolean attribute (an `i1`/PRED scalar, as `jax.ffi.ffi_call` encodes Python and NumPy bools).
    pub fn attr_bool(&self, name: &str) -> Result<bool> {
        let (dtype, v) = self.scalar(name, "a bool scalar")?;
        if dtype != XLA_FFI_DATA_TYPE_PRED {
            return Err(Error::invalid(format!(
                "attribute `{name}`: expected a bool (pred) scalar, got a {} scalar",
                dtype_from_xla(dtype).name()
            )));
        }
        // SAFETY: a PRED scalar is one byte.
        Ok(unsafe { (v as *const u8).read() } != 0)
    }

    /// A float attribute: an f32 scalar (what `jax.ffi.ffi_call` makes of `np.float32`), or an f64
    /// one (a Python float with x64 on), rounded to f32.
    pub fn attr_f32(&self, name: &str) -> Result<f32> {
        let (dtype, v) = self.scalar(name, "a float scalar")?;
        // SAFETY: the value has its dtype's size.
        unsafe {
            match dtype {
                XLA_FFI_DATA_TYPE_F32 => Ok((v as *const f32).read_unaligned()),
                XLA_FFI_DATA_TYPE_F64 => Ok((v as *const f64).read_unaligned() as f32),
                other => Err(Error::invalid(format!(
                    "attribute `{name}`: expected an f32 scalar, got a {} scalar",
                    dtype_from_xla(other).name()
                ))),
            }
        }
    }

    /// A string attribute.
    pub fn attr_str(&self, name: &str) -> Result<String> {
        let (ty, value) = self.attr(name)?;
        if ty != XLA_FFI_ATTR_TYPE_STRING {
            return Err(Error::invalid(format!("attribute `{name}`: expected a string, got {}", attr_type_name(ty))));
        }
        // SAFETY: a string attribute's entry is null or points at a byte span.
        let bytes = unsafe { byte_span(value as *const XLA_FFI_ByteSpan) }
            .ok_or_else(|| Error::invalid(format!("attribute `{name}`: the string has no data")))?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    /// The platform stream of this call (a `CUstream` on CUDA).
    pub fn stream(&self) -> Result<*mut c_void> {
        let get = self
            .api
            .XLA_FFI_Stream_Get
            .ok_or_else(|| Error::Internal("XLA_FFI_Stream_Get is missing from the API table".into()))?;
        let mut args = XLA_FFI_Stream_Get_Args {
            struct_size: stream_get_args_struct_size(),
            extension_start: std::ptr::null_mut(),
            ctx: self.raw.ctx,
            stream: std::ptr::null_mut(),
        };
        // SAFETY: a call into XLA's own table with a well-formed argument struct.
        let err = unsafe { get(&mut args) };
        if !err.is_null() {
            let msg = take_error_message(self.api, err);
            return Err(Error::Internal(format!("could not get the CUDA stream from XLA: {msg}")));
        }
        Ok(args.stream)
    }
}

/// The library's name for an XLA element type.
pub fn dtype_from_xla(code: XLA_FFI_DataType) -> DType {
    match code {
        XLA_FFI_DATA_TYPE_F32 => DType::F32,
        XLA_FFI_DATA_TYPE_BF16 => DType::BF16,
        XLA_FFI_DATA_TYPE_F16 => DType::F16,
        XLA_FFI_DATA_TYPE_F64 => DType::F64,
        XLA_FFI_DATA_TYPE_PRED => DType::Pred,
        XLA_FFI_DATA_TYPE_S8 => DType::S8,
        XLA_FFI_DATA_TYPE_S16 => DType::S16,
        XLA_FFI_DATA_TYPE_S32 => DType::S32,
        XLA_FFI_DATA_TYPE_S64 => DType::S64,
        XLA_FFI_DATA_TYPE_U8 => DType::U8,
        other => DType::Other(other),
    }
}

fn attr_type_name(ty: XLA_FFI_AttrType) -> &'static str {
    match ty {
        XLA_FFI_ATTR_TYPE_ARRAY => "an array",
        XLA_FFI_ATTR_TYPE_DICTIONARY => "a dictionary",
        XLA_FFI_ATTR_TYPE_SCALAR => "a scalar",
        XLA_FFI_ATTR_TYPE_STRING => "a string",
        _ => "an attribute of unknown type",
    }
}

unsafe fn buffer_to_tensor(buf: *const XLA_FFI_Buffer, what: &str, index: usize, name: &str) -> Result<Tensor> {
    if buf.is_null() {
        return Err(Error::invalid(format!("{what} {index} (`{name}`) is a null buffer")));
    }
    let buf = &*buf;
    if buf.struct_size < buffer_struct_size() {
        return Err(Error::invalid(format!(
            "{what} {index} (`{name}`): unexpected XLA_FFI_Buffer size {} (expected at least {})",
            buf.struct_size,
            buffer_struct_size()
        )));
    }
    if !(0..=MAX_RANK).contains(&buf.rank) {
        return Err(Error::invalid(format!("{what} {index} (`{name}`): rank {} is not in 0..={MAX_RANK}", buf.rank)));
    }
    if buf.rank > 0 && buf.dims.is_null() {
        return Err(Error::invalid(format!("{what} {index} (`{name}`): rank {} but no dimensions", buf.rank)));
    }
    let dims =
        if buf.rank == 0 { Vec::new() } else { std::slice::from_raw_parts(buf.dims, buf.rank as usize).to_vec() };
    crate::ops::check_sizes(&format!("{what} {index}"), &[(name, &dims)])?;
    Ok(Tensor { dtype: dtype_from_xla(buf.dtype), dims, data: buf.data })
}

/// Reads and destroys an error that XLA returned to us.
pub(crate) fn take_error_message(api: &XLA_FFI_Api, err: *mut XLA_FFI_Error) -> String {
    let mut msg = String::from("(no message)");
    if let Some(get) = api.XLA_FFI_Error_GetMessage {
        let mut args = XLA_FFI_Error_GetMessage_Args {
            struct_size: struct_size!(XLA_FFI_Error_GetMessage_Args, message),
            extension_start: std::ptr::null_mut(),
            error: err,
            message: std::ptr::null(),
        };
        // SAFETY: XLA's own table; the message lives until the error is destroyed.
        unsafe {
            get(&mut args);
            if !args.message.is_null() {
                msg = std::ffi::CStr::from_ptr(args.message).to_string_lossy().into_owned();
            }
        }
    }
    if let Some(destroy) = api.XLA_FFI_Error_Destroy {
        let mut args = XLA_FFI_Error_Destroy_Args {
            struct_size: struct_size!(XLA_FFI_Error_Destroy_Args, error),
            extension_start: std::ptr::null_mut(),
            error: err,
        };
        // SAFETY: as above.
        unsafe { destroy(&mut args) };
    }
    msg
}

/// Turns an [`Error`] into an `XLA_FFI_Error` through the API table (XLA owns the result).
pub fn make_error(api: &XLA_FFI_Api, error: &Error) -> *mut XLA_FFI_Error {
    let code = match error {
        Error::InvalidArgument(_) => XLA_FFI_ERROR_CODE_INVALID_ARGUMENT,
        Error::Unimplemented(_) => XLA_FFI_ERROR_CODE_UNIMPLEMENTED,
        Error::Cuda(_) | Error::Internal(_) => XLA_FFI_ERROR_CODE_INTERNAL,
    };
    let message = CString::new(error.message().replace('\0', " ")).unwrap_or_default();
    let Some(create) = api.XLA_FFI_Error_Create else {
        return std::ptr::null_mut();
    };
    let mut args = XLA_FFI_Error_Create_Args {
        struct_size: error_create_args_struct_size(),
        extension_start: std::ptr::null_mut(),
        message: message.as_ptr(),
        errc: code,
    };
    // SAFETY: XLA copies the message before returning.
    unsafe { create(&mut args) }
}
