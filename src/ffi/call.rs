use super::buffer::byte_range;
use super::{Arg, Attr, DataType, Error, Result, Ret};
use crate::invalid;
use std::cell::Cell;
use std::ffi::{c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;
use xla_ffi_sys as sys;

/// Properties a handler promises XLA (reported in its metadata).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Traits(sys::XLA_FFI_Handler_Traits);

impl Traits {
    pub const NONE: Self = Self(0);
    /// Launches the same device work on every call: safe to capture in a CUDA graph.
    pub const COMMAND_BUFFER_COMPATIBLE: Self = Self(sys::XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
}

/// One call of a handler: its arguments, results and attributes, at the
/// execute stage or (a command-buffer-compatible handler's) initialize stage.
pub struct Call<'a> {
    frame: &'a sys::XLA_FFI_CallFrame,
    /// Bit `i`: result `i` was handed out.
    rets_taken: Cell<u64>,
    /// The result that [`Call::workspace`] handed out, if any.
    workspace: Cell<Option<usize>>,
    /// Bit `i`: attribute `i` was read.
    attrs_read: Cell<u64>,
}

/// The most results and attributes a call may have (one bit each above).
const MAX_RETS_OR_ATTRS: usize = 64;

impl<'a> Call<'a> {
    /// The number of arguments passed.
    pub fn num_args(&self) -> usize {
        self.frame.args.size.max(0) as usize
    }

    /// Checks the argument count is within `min..=max`.
    pub fn expect_num_args(&self, min: usize, max: usize) -> Result<()> {
        let n = self.num_args();
        if n < min || n > max {
            let want = if min == max { min.to_string() } else { format!("{min} to {max}") };
            invalid!("got {n} arguments, expected {want}")
        }
        Ok(())
    }

    /// Argument `index`, called `name` in error messages.
    pub fn arg(&self, index: usize, name: &'static str) -> Result<Arg<'a>> {
        self.optional_arg(index, name)?
            .ok_or_else(|| Error::invalid_argument(format!("argument {index} ({name}) is missing")))
    }

    /// Argument `index` if it was passed.
    pub fn optional_arg(&self, index: usize, name: &'static str) -> Result<Option<Arg<'a>>> {
        let args = &self.frame.args;
        if index >= self.num_args() {
            return Ok(None);
        }
        // SAFETY: XLA passes `size` argument types and pointers.
        let (kind, ptr) = unsafe { (*args.types.add(index), *args.args.add(index)) };
        if kind != sys::XLA_FFI_ArgType_BUFFER {
            invalid!("argument {index} ({name}) is not a buffer")
        }
        // SAFETY: a BUFFER argument points at an `XLA_FFI_Buffer`.
        Ok(Some(Arg::new(unsafe { &*ptr.cast::<sys::XLA_FFI_Buffer>() }, name)?))
    }

    /// Result `index`, called `name` in error messages; each result is handed out once.
    pub fn ret(&self, index: usize, name: &'static str) -> Result<Ret<'a>> {
        let rets = &self.frame.rets;
        if index >= rets.size.max(0) as usize {
            invalid!("result {index} ({name}) is missing: the call has {} results", rets.size)
        }
        let bit = 1u64 << index.min(63);
        if self.rets_taken.get() & bit != 0 {
            return Err(Error::internal(format!("result {index} ({name}) taken twice")));
        }
        self.rets_taken.set(self.rets_taken.get() | bit);
        // SAFETY: XLA passes `size` result types and pointers.
        let (kind, ptr) = unsafe { (*rets.types.add(index), *rets.rets.add(index)) };
        if kind != sys::XLA_FFI_RetType_BUFFER {
            invalid!("result {index} ({name}) is not a buffer")
        }
        // SAFETY: a BUFFER result points at an `XLA_FFI_Buffer`.
        Ret::new(unsafe { &*ptr.cast::<sys::XLA_FFI_Buffer>() }, name)
    }

    /// Result `index` as the call's workspace: `uint8[bytes]` of device memory
    /// for its kernels' own use. XLA assigns it like any result, so its address
    /// is fixed for the executable and a CUDA graph that captured the call
    /// replays with it; memory allocated during the call would be freed (and
    /// reused) while the graph still pointed at it. Not a result the caller
    /// reads: [`Call::writes_nothing`] does not count it.
    pub fn workspace(&self, index: usize, bytes: usize) -> Result<Ret<'a>> {
        let workspace = self.ret(index, "workspace")?;
        if workspace.dtype() != DataType::U8 || workspace.dims() != [bytes as i64] {
            invalid!(
                "the workspace (result {index}) is {}{:?}, but this call needs uint8[{bytes}]: the Python package and \
                 the library disagree on it (install both from one build)",
                workspace.dtype(),
                workspace.dims()
            )
        }
        self.workspace.set(Some(index));
        Ok(workspace)
    }

    /// Whether this call runs at the initialize stage, where a device handler
    /// loads the kernels its execute stage will launch and launches nothing.
    pub fn initializes(&self) -> bool {
        self.frame.stage == sys::XLA_FFI_ExecutionStage_INITIALIZE
    }

    /// The platform stream (a `CUstream` on CUDA) the handler must launch on.
    pub fn stream(&self) -> Result<*mut c_void> {
        let api = self.api()?;
        let get = api.XLA_FFI_Stream_Get.ok_or_else(|| Error::internal("XLA API has no XLA_FFI_Stream_Get"))?;
        let mut args = sys::XLA_FFI_Stream_Get_Args {
            struct_size: sys::XLA_FFI_Stream_Get_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            ctx: self.frame.ctx,
            stream: std::ptr::null_mut(),
        };
        // SAFETY: a valid argument struct for the call's execution context.
        check_api(api, "XLA_FFI_Stream_Get", unsafe { get(&mut args) })?;
        Ok(args.stream)
    }

    fn api(&self) -> Result<&'a sys::XLA_FFI_Api> {
        // SAFETY: XLA passes a valid API table with every call frame.
        unsafe { self.frame.api.as_ref() }.ok_or_else(|| Error::internal("call frame without an XLA API"))
    }

    /// The non-negative integer attribute `name` (an `i64` attribute).
    pub fn count(&self, name: &str) -> Result<usize> {
        let value: i64 = self.attr(name)?;
        match usize::try_from(value) {
            Ok(count) => Ok(count),
            Err(_) => invalid!("attribute `{name}` is {value}, expected a non-negative integer"),
        }
    }

    /// The attribute `name`, decoded as `T`.
    pub fn attr<T: Attr<'a>>(&self, name: &str) -> Result<T> {
        match self.optional_attr(name)? {
            Some(value) => Ok(value),
            None => invalid!("attribute `{name}` ({}) is missing", T::EXPECTED),
        }
    }

    /// The bool attribute `zero_unused_rows` of a call that writes rows in
    /// groups: whether the rows outside them are zeroed or left unwritten
    /// (for callers that read only the groups' rows). A call without it
    /// zeroes, as every call did before the attribute existed.
    pub fn zero_unused_rows(&self) -> Result<bool> {
        Ok(self.optional_attr("zero_unused_rows")?.unwrap_or(true))
    }

    /// The attribute `name`, decoded as `T`, if the call has it.
    pub fn optional_attr<T: Attr<'a>>(&self, name: &str) -> Result<Option<T>> {
        let attrs = &self.frame.attrs;
        for i in 0..attrs.size.max(0) as usize {
            // SAFETY: XLA passes `size` attribute names, types and values.
            let (span, kind, value) = unsafe { (&**attrs.names.add(i), *attrs.types.add(i), *attrs.attrs.add(i)) };
            // SAFETY: a byte span of `len` bytes.
            let key = unsafe { byte_span(span) };
            if key == name.as_bytes() {
                self.attrs_read.set(self.attrs_read.get() | 1u64 << i.min(MAX_RETS_OR_ATTRS - 1));
                // SAFETY: `value` is the attribute that `kind` describes.
                return unsafe { T::decode(name, kind, value.cast_const()) }.map(Some);
            }
        }
        Ok(None)
    }

    /// Checks, once a handler has decoded its call, that the call holds
    /// nothing the handler did not take (every result is one it writes, every
    /// attribute one it reads) and that no result shares memory with an
    /// argument: a handler reads its arguments as shared slices while it
    /// writes its results, so aliases (`input_output_aliases`) are refused.
    pub fn check_complete(&self) -> Result<()> {
        let (rets, attrs) = (self.frame.rets.size.max(0) as usize, self.frame.attrs.size.max(0) as usize);
        if rets > MAX_RETS_OR_ATTRS || attrs > MAX_RETS_OR_ATTRS {
            invalid!("the call has {rets} results and {attrs} attributes, more than any oxmoe handler takes")
        }
        let taken = self.rets_taken.get().count_ones() as usize;
        if taken != rets {
            invalid!("the call has {rets} results, expected {taken}")
        }
        let unknown: Vec<String> = (0..attrs)
            .filter(|&i| self.attrs_read.get() & (1u64 << i) == 0)
            // SAFETY: XLA passes `size` attribute names.
            .map(|i| format!("`{}`", String::from_utf8_lossy(unsafe { byte_span(&**self.frame.attrs.names.add(i)) })))
            .collect();
        if !unknown.is_empty() {
            invalid!("unknown attribute{} {}", if unknown.len() == 1 { "" } else { "s" }, unknown.join(", "))
        }
        for (r, written) in self.result_buffers() {
            let Some(written) = byte_range(written) else { continue };
            let args = &self.frame.args;
            // SAFETY: XLA passes `size` argument types and pointers.
            for (a, read) in unsafe { buffers(args.types, args.args, args.size) } {
                if byte_range(read).is_some_and(|read| read.start < written.end && written.start < read.end) {
                    invalid!("result {r} shares memory with argument {a}: oxmoe handlers do not compute in place (no input_output_aliases)")
                }
            }
        }
        Ok(())
    }

    /// The result buffers with their indices, for a device handler to poison
    /// when [`poisons_results`](super::poisons_results).
    pub fn result_buffers(&self) -> impl Iterator<Item = (usize, &'a sys::XLA_FFI_Buffer)> {
        let rets = &self.frame.rets;
        // SAFETY: XLA passes `size` result types and pointers.
        unsafe { buffers(rets.types, rets.rets, rets.size) }
    }

    /// Whether no result but the workspace holds an element: then the handler
    /// has nothing to write.
    pub fn writes_nothing(&self) -> bool {
        let workspace = self.workspace.get();
        self.result_buffers().all(|(i, result)| Some(i) == workspace || byte_range(result).is_none())
    }
}

/// The buffers of an argument or result list (`types` and `pointers` of `size`
/// entries; a BUFFER entry points at an `XLA_FFI_Buffer`), with their indices.
///
/// # Safety
/// Both arrays must hold `size` entries that live as long as `'a`.
unsafe fn buffers<'a>(types: *const u32, pointers: *const *mut c_void, size: i64) -> impl Iterator<Item = (usize, &'a sys::XLA_FFI_Buffer)> {
    (0..size.max(0) as usize).filter_map(move |i| {
        // SAFETY: the caller's contract (argument and result lists mark a buffer alike).
        unsafe { (*types.add(i) == sys::XLA_FFI_ArgType_BUFFER).then(|| (i, &*(*pointers.add(i)).cast())) }
    })
}

/// The bytes of an XLA byte span.
///
/// # Safety
/// `span` must describe `len` readable bytes (or have `len` 0).
unsafe fn byte_span(span: &sys::XLA_FFI_ByteSpan) -> &[u8] {
    if span.len == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(span.ptr.cast::<u8>(), span.len)
    }
}

/// Turns an error returned by an XLA API function into ours (taking its message
/// and destroying it).
fn check_api(api: &sys::XLA_FFI_Api, function: &str, error: *mut sys::XLA_FFI_Error) -> Result<()> {
    if error.is_null() {
        return Ok(());
    }
    let mut message = format!("{function} failed");
    if let Some(get_message) = api.XLA_FFI_Error_GetMessage {
        let mut args = sys::XLA_FFI_Error_GetMessage_Args {
            struct_size: sys::XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            error,
            message: std::ptr::null(),
        };
        // SAFETY: `error` came from the API; the message lives until it is destroyed.
        unsafe { get_message(&mut args) };
        if !args.message.is_null() {
            // SAFETY: a NUL-terminated string owned by `error`.
            message = format!("{function} failed: {}", unsafe { std::ffi::CStr::from_ptr(args.message) }.to_string_lossy());
        }
    }
    if let Some(destroy) = api.XLA_FFI_Error_Destroy {
        let mut args = sys::XLA_FFI_Error_Destroy_Args {
            struct_size: sys::XLA_FFI_Error_Destroy_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            error,
        };
        // SAFETY: the error is ours to destroy, once.
        unsafe { destroy(&mut args) };
    }
    Err(Error::internal(message))
}

/// Runs `body` as the handler `target` for the call frame XLA passed.
///
/// Answers XLA's metadata query, refuses any stage but execute (and
/// initialize, for a handler with [`Traits::COMMAND_BUFFER_COMPATIBLE`]), and
/// turns an error or a panic into an `XLA_FFI_Error` whose message starts with
/// `target`.
///
/// # Safety
/// `frame` must be null or a call frame handed over by the XLA runtime.
pub unsafe fn run_handler(
    target: &'static str,
    traits: Traits,
    frame: *mut sys::XLA_FFI_CallFrame,
    body: fn(&Call) -> Result<()>,
) -> *mut sys::XLA_FFI_Error {
    let Some(frame) = frame.as_mut() else {
        return std::ptr::null_mut();
    };
    let api = frame.api;
    let outcome = {
        let _quiet = QuietPanics::begin();
        catch_unwind(AssertUnwindSafe(|| dispatch(frame, traits, body)))
    };
    let error = match outcome {
        Ok(Ok(())) => return std::ptr::null_mut(),
        Ok(Err(error)) => error,
        Err(panic) => Error::internal(format!("internal error (panic): {}", panic_message(&*panic))),
    };
    create_error(api, target, &error)
}

fn dispatch(frame: &mut sys::XLA_FFI_CallFrame, traits: Traits, body: fn(&Call) -> Result<()>) -> Result<()> {
    if frame.struct_size < sys::XLA_FFI_CallFrame_STRUCT_SIZE as usize {
        return Err(Error::internal(format!(
            "XLA passed a call frame of {} bytes, expected at least {}: the XLA FFI API in use is older than oxmoe's (0.{})",
            frame.struct_size,
            sys::XLA_FFI_CallFrame_STRUCT_SIZE,
            sys::XLA_FFI_API_MINOR
        )));
    }
    // SAFETY: XLA's extension chain is a linked list of valid extensions.
    if let Some(metadata) = unsafe { find_metadata(frame.extension_start) } {
        return fill_metadata(metadata, traits);
    }
    // A handler XLA may capture in a CUDA graph loads its kernels at the
    // initialize stage, before any capture: its execute stage only launches.
    let initializes = traits == Traits::COMMAND_BUFFER_COMPATIBLE && frame.stage == sys::XLA_FFI_ExecutionStage_INITIALIZE;
    if frame.stage != sys::XLA_FFI_ExecutionStage_EXECUTE && !initializes {
        invalid!("called at execution stage {}, but this oxmoe handler runs at the execute stage (3) only", frame.stage)
    }
    body(&Call { frame, rets_taken: Cell::new(0), workspace: Cell::new(None), attrs_read: Cell::new(0) })
}

thread_local! {
    /// Whether this thread is inside a handler call.
    static IN_HANDLER: Cell<bool> = const { Cell::new(false) };
}

/// Handler calls under way, in any thread.
static ACTIVE_CALLS: AtomicUsize = AtomicUsize::new(0);

/// While alive, a panic of the handler's own thread, or of a rayon worker
/// doing a handler's parallel work, prints nothing: its message travels in
/// the error the handler returns. Other panics go to the hook that was there
/// before (Rust's default: a message on stderr).
struct QuietPanics;

impl QuietPanics {
    fn begin() -> Self {
        static INSTALL: Once = Once::new();
        INSTALL.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                let in_handler = IN_HANDLER.get()
                    || (rayon::current_thread_index().is_some() && ACTIVE_CALLS.load(Ordering::SeqCst) > 0);
                if !in_handler {
                    previous(info);
                }
            }));
        });
        IN_HANDLER.set(true);
        ACTIVE_CALLS.fetch_add(1, Ordering::SeqCst);
        Self
    }
}

impl Drop for QuietPanics {
    fn drop(&mut self) {
        ACTIVE_CALLS.fetch_sub(1, Ordering::SeqCst);
        IN_HANDLER.set(false);
    }
}

unsafe fn find_metadata(mut extension: *mut sys::XLA_FFI_Extension_Base) -> Option<&'static mut sys::XLA_FFI_Metadata_Extension> {
    while let Some(ext) = extension.as_mut() {
        if ext.type_ == sys::XLA_FFI_Extension_Metadata {
            return Some(&mut *extension.cast::<sys::XLA_FFI_Metadata_Extension>());
        }
        extension = ext.next;
    }
    None
}

/// Tells XLA which FFI API version the handler was built against, and its traits.
fn fill_metadata(extension: &mut sys::XLA_FFI_Metadata_Extension, traits: Traits) -> Result<()> {
    if extension.extension_base.struct_size < sys::XLA_FFI_Metadata_Extension_STRUCT_SIZE as usize {
        return Err(Error::internal("XLA passed a metadata extension smaller than XLA FFI API 0.3 defines"));
    }
    // SAFETY: the extension carries a valid metadata pointer.
    let Some(metadata) = (unsafe { extension.metadata.as_mut() }) else {
        return Err(Error::internal("XLA passed a metadata extension without metadata"));
    };
    if metadata.struct_size < sys::XLA_FFI_Metadata_STRUCT_SIZE as usize {
        return Err(Error::internal("XLA passed metadata smaller than XLA FFI API 0.3 defines"));
    }
    metadata.api_version = sys::XLA_FFI_Api_Version {
        struct_size: sys::XLA_FFI_Api_Version_STRUCT_SIZE as usize,
        extension_start: std::ptr::null_mut(),
        major_version: sys::XLA_FFI_API_MAJOR as i32,
        minor_version: sys::XLA_FFI_API_MINOR as i32,
    };
    metadata.traits = traits.0;
    Ok(())
}

fn create_error(api: *const sys::XLA_FFI_Api, target: &str, error: &Error) -> *mut sys::XLA_FFI_Error {
    // SAFETY: XLA passes a valid API table with every call frame.
    let Some(create) = (unsafe { api.as_ref() }).and_then(|api| api.XLA_FFI_Error_Create) else {
        return std::ptr::null_mut();
    };
    let text = format!("{target}: {}", error.message()).replace('\0', " ");
    let message = CString::new(text).expect("NUL bytes were replaced");
    let mut args = sys::XLA_FFI_Error_Create_Args {
        struct_size: sys::XLA_FFI_Error_Create_Args_STRUCT_SIZE as usize,
        extension_start: std::ptr::null_mut(),
        message: message.as_ptr(),
        errc: error.code(),
    };
    // SAFETY: XLA copies the message; `args` lives across the call.
    unsafe { create(&mut args) }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = panic.downcast_ref::<String>() {
        text.clone()
    } else {
        "unknown panic".to_owned()
    }
}

