use super::{DataType, Error, Result};
use crate::invalid;
use half::{bf16, f16};
use xla_ffi_sys as sys;

/// A Rust type that matches one XLA element type bit for bit.
///
/// # Safety
/// `DTYPE` must have exactly the size, alignment and bit validity of `Self`.
pub unsafe trait Element: Copy + Send + Sync + 'static {
    const DTYPE: DataType;
}

unsafe impl Element for f32 {
    const DTYPE: DataType = DataType::F32;
}
unsafe impl Element for bf16 {
    const DTYPE: DataType = DataType::BF16;
}
unsafe impl Element for f16 {
    const DTYPE: DataType = DataType::F16;
}
unsafe impl Element for i32 {
    const DTYPE: DataType = DataType::S32;
}

/// What argument and result buffers share: a name for messages, a dtype and
/// dimensions, checked against what the handler expects.
struct View<'a> {
    raw: &'a sys::XLA_FFI_Buffer,
    name: &'static str,
}

impl<'a> View<'a> {
    fn dtype(&self) -> DataType {
        DataType(self.raw.dtype)
    }

    fn dims(&self) -> &'a [i64] {
        match usize::try_from(self.raw.rank) {
            // SAFETY: XLA hands `rank` dimensions behind `dims`.
            Ok(rank) if rank > 0 => unsafe { std::slice::from_raw_parts(self.raw.dims, rank) },
            _ => &[],
        }
    }

    /// The number of elements; `usize::MAX` for dimensions whose product
    /// overflows (no such buffer exists, and `data` refuses it).
    fn len(&self) -> usize {
        element_count(self.dims())
    }

    fn shape_string(&self) -> String {
        let dims: Vec<String> = self.dims().iter().map(i64::to_string).collect();
        format!("{}[{}]", self.dtype(), dims.join(", "))
    }

    fn expect_dtype(&self, allowed: &[DataType]) -> Result<DataType> {
        let dtype = self.dtype();
        if allowed.contains(&dtype) {
            return Ok(dtype);
        }
        let names: Vec<&str> = allowed.iter().map(|d| d.name()).collect();
        invalid!("{} has dtype {dtype}, expected {}", self.name, names.join(" or "))
    }

    fn expect_shape(&self, shape: &[usize]) -> Result<()> {
        let dims = self.dims();
        if dims.len() == shape.len() && dims.iter().zip(shape).all(|(&d, &s)| d as usize == s && d >= 0) {
            return Ok(());
        }
        let want: Vec<String> = shape.iter().map(usize::to_string).collect();
        invalid!("{} has shape {}, expected [{}]", self.name, self.shape_string(), want.join(", "))
    }

    fn matrix(&self) -> Result<(usize, usize)> {
        match *self.dims() {
            [rows, cols] if rows >= 0 && cols >= 0 => Ok((rows as usize, cols as usize)),
            _ => invalid!("{} has shape {}, expected a matrix [rows, columns]", self.name, self.shape_string()),
        }
    }

    fn data<T>(&self, dtype: DataType) -> Result<*mut T> {
        if self.dtype() != dtype {
            invalid!("{} has dtype {}, expected {dtype}", self.name, self.dtype())
        }
        let data = self.raw.data.cast::<T>();
        if self.len() > 0 && (data.is_null() || !data.is_aligned()) {
            return Err(Error::internal(format!("{} has a null or misaligned data pointer", self.name)));
        }
        Ok(data)
    }
}

/// The product of `dims` (negative ones count as 0), saturating at `usize::MAX`.
fn element_count(dims: &[i64]) -> usize {
    let dims = dims.iter().map(|&d| d.max(0) as usize);
    if dims.clone().any(|d| d == 0) {
        return 0;
    }
    dims.fold(1usize, usize::saturating_mul)
}

/// The bytes a buffer's data spans, `None` when it spans none (or its element
/// type is none a handler takes).
pub(crate) fn byte_range(raw: &sys::XLA_FFI_Buffer) -> Option<std::ops::Range<usize>> {
    let view = View { raw, name: "" };
    let bytes = view.len().saturating_mul(view.dtype().size()?);
    let start = raw.data as usize;
    (bytes > 0).then(|| start..start.saturating_add(bytes))
}

/// An argument buffer: read-only.
pub struct Arg<'a>(View<'a>);

/// A result buffer: the handler writes it.
pub struct Ret<'a>(View<'a>);

macro_rules! shared_accessors {
    ($ty:ident) => {
        impl<'a> $ty<'a> {
            /// The buffer, unless its dimensions claim more bytes than any
            /// buffer can hold (a slice spans at most `isize::MAX` bytes; a
            /// type of no known size is refused where its dtype is checked).
            pub(crate) fn new(raw: &'a sys::XLA_FFI_Buffer, name: &'static str) -> Result<Self> {
                let view = View { raw, name };
                let bytes = view.dtype().size().map(|size| view.len().checked_mul(size));
                if bytes.is_some_and(|bytes| bytes.is_none_or(|bytes| bytes > isize::MAX as usize)) {
                    invalid!("{name} has shape {}: more bytes than any buffer can hold", view.shape_string())
                }
                Ok(Self(view))
            }

            /// The element type.
            pub fn dtype(&self) -> DataType {
                self.0.dtype()
            }

            /// The dimensions, major to minor.
            pub fn dims(&self) -> &'a [i64] {
                self.0.dims()
            }

            /// The number of elements.
            pub fn len(&self) -> usize {
                self.0.len()
            }

            pub fn is_empty(&self) -> bool {
                self.0.len() == 0
            }

            /// Checks the element type is one of `allowed` and returns it.
            pub fn expect_dtype(&self, allowed: &[DataType]) -> Result<DataType> {
                self.0.expect_dtype(allowed)
            }

            /// Checks the element type is one of `allowed` and the dimensions
            /// are exactly `shape`; returns the element type.
            pub fn expect(&self, allowed: &[DataType], shape: &[usize]) -> Result<DataType> {
                let dtype = self.0.expect_dtype(allowed)?;
                self.0.expect_shape(shape)?;
                Ok(dtype)
            }

            /// The dimensions of a rank-2 buffer, or an error.
            pub fn matrix(&self) -> Result<(usize, usize)> {
                self.0.matrix()
            }
        }
    };
}
shared_accessors!(Arg);
shared_accessors!(Ret);

macro_rules! device_address {
    ($ty:ident) => {
        impl $ty<'_> {
            /// The address of the data, for a device kernel (a host handler reads
            /// through `slice`/`mask` instead).
            pub fn device_ptr(&self) -> u64 {
                self.0.raw.data as u64
            }
        }
    };
}
device_address!(Arg);
device_address!(Ret);

impl<'a> Arg<'a> {
    /// The elements, if the buffer holds `T`.
    pub fn slice<T: Element>(&self) -> Result<&'a [T]> {
        let data = self.0.data::<T>(T::DTYPE)?;
        // SAFETY: XLA keeps the argument alive, initialised and unwritten for
        // the duration of the call; dtype, length and alignment were checked.
        Ok(unsafe { slice_or_empty(data, self.len()) })
    }

    /// A `bool` buffer as bytes that are 0 or 1.
    pub fn mask(&self) -> Result<&'a [u8]> {
        let data = self.0.data::<u8>(DataType::PRED)?;
        // SAFETY: as in `slice`; XLA stores `bool` as one byte.
        Ok(unsafe { slice_or_empty(data, self.len()) })
    }
}

impl<'a> Ret<'a> {
    /// The elements to write, if the buffer holds `T`. Consumes the handle, so
    /// one result is never borrowed twice. Holds [`poison_byte`]s when
    /// [`poisons_results`].
    pub fn slice_mut<T: Element>(self) -> Result<&'a mut [T]> {
        let data = self.0.data::<T>(T::DTYPE)?;
        let len = self.len();
        poison_host(data.cast(), len * std::mem::size_of::<T>(), T::DTYPE);
        // SAFETY: XLA owns the result for the call and nothing else touches it;
        // `Call::ret` hands each result out once, and `Call::check_complete`
        // refused results that share memory with an argument.
        Ok(unsafe { slice_or_empty_mut(data, len) })
    }

    /// A `bool` result as bytes; write 0 or 1.
    pub fn mask_mut(self) -> Result<&'a mut [u8]> {
        let data = self.0.data::<u8>(DataType::PRED)?;
        poison_host(data, self.len(), DataType::PRED);
        // SAFETY: as in `slice_mut`.
        Ok(unsafe { slice_or_empty_mut(data, self.len()) })
    }
}

/// Whether handlers fill their results with [`poison_byte`]s before computing
/// them (the environment variable `OXMOE_POISON_RESULTS=1`, read once): a
/// test then sees every element a handler leaves unwritten as NaN or garbage.
pub fn poisons_results() -> bool {
    static POISON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *POISON.get_or_init(|| std::env::var_os("OXMOE_POISON_RESULTS").is_some_and(|v| v == "1"))
}

/// The byte a poisoned result of `dtype` is filled with: 0xFF (NaN in every
/// float type, 255 in a bool), 0x80 in integers (no valid index or count).
pub fn poison_byte(dtype: DataType) -> u8 {
    if matches!(dtype, DataType::S32 | DataType::S64) {
        0x80
    } else {
        0xFF
    }
}

fn poison_host(data: *mut u8, bytes: usize, dtype: DataType) {
    if poisons_results() && bytes > 0 {
        // SAFETY: `data` holds `bytes` bytes of the result, not yet borrowed.
        unsafe { std::ptr::write_bytes(data, poison_byte(dtype), bytes) };
    }
}

unsafe fn slice_or_empty<'a, T>(data: *mut T, len: usize) -> &'a [T] {
    if len == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(data, len)
    }
}

unsafe fn slice_or_empty_mut<'a, T>(data: *mut T, len: usize) -> &'a mut [T] {
    if len == 0 {
        &mut []
    } else {
        std::slice::from_raw_parts_mut(data, len)
    }
}
