//! Loading kernels into the CUDA context of XLA's stream and launching them.

use super::nvrtc::{cubin, Architecture};
use super::{driver_error, Source};
use crate::ffi::{byte_range, poison_byte, poisons_results, DataType, Error, Result};
use cudarc::driver::sys::{self, CUcontext, CUdevice_attribute, CUfunction, CUmodule, CUstream};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

fn check(call: &str, result: sys::CUresult) -> Result<()> {
    result.result().map_err(|e| driver_error(call, e))
}

/// Loads the driver and initialises it, once.
fn init_driver() -> Result<()> {
    static INIT: OnceLock<std::result::Result<(), Error>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only tries to open the library.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::internal("the CUDA driver (libcuda.so.1) could not be loaded"));
        }
        // SAFETY: cuInit may be called any number of times.
        check("cuInit", unsafe { sys::cuInit(0) })
    })
    .clone()
}

/// Makes `ctx` current on this thread for the life of the guard. XLA usually
/// calls a handler with its device's context current already; then nothing is
/// pushed.
struct ContextGuard {
    pushed: bool,
}

impl ContextGuard {
    fn push(ctx: CUcontext) -> Result<Self> {
        let mut current = std::ptr::null_mut();
        // SAFETY: an out-parameter.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut current) })?;
        if current == ctx {
            return Ok(Self { pushed: false });
        }
        // SAFETY: `ctx` is the live context of XLA's stream.
        check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(ctx) })?;
        Ok(Self { pushed: true })
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if self.pushed {
            let mut popped = std::ptr::null_mut();
            // SAFETY: pops what `push` pushed on this thread.
            unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        }
    }
}

/// A CUDA stream that XLA handed a handler (valid for the handler's call).
/// At the initialize stage it launches nothing: the call only loads the
/// kernels its execute stage will launch, so that a CUDA graph capturing that
/// stage records launches and nothing else (no compilation, no module load).
#[derive(Clone, Copy)]
pub struct Stream {
    raw: CUstream,
    launches: bool,
}

impl Stream {
    /// The stream XLA hands a CUDA handler's call, which its work goes on: all
    /// a CUDA backend takes of the call besides its decoded buffers (memory of
    /// the kernels' own comes as the call's workspace result, never allocated
    /// during the call, so that XLA may capture the call in a CUDA graph).
    /// When results are poisoned (`OXMOE_POISON_RESULTS=1`, for tests), fills
    /// each result with its poison byte on the stream first.
    pub fn begin(call: &crate::ffi::Call) -> Result<Self> {
        // CUDA handlers run on the CUDA platform, where XLA's stream is a CUstream.
        let stream = Self { raw: call.stream()?.cast(), launches: !call.initializes() };
        if poisons_results() && stream.launches {
            for (_, result) in call.result_buffers() {
                let Some(bytes) = byte_range(result) else { continue };
                let byte = poison_byte(DataType(result.dtype));
                let _current = ContextGuard::push(stream.context()?)?;
                // SAFETY: the result's device memory, `bytes.len()` bytes, on XLA's stream.
                check("cuMemsetD8Async", unsafe { sys::cuMemsetD8Async(bytes.start as u64, byte, bytes.len(), stream.raw) })?;
            }
        }
        Ok(stream)
    }
}

/// A kernel loaded into one CUDA context, ready to launch on its streams.
#[derive(Clone, Copy)]
pub struct Kernel {
    context: CUcontext,
    function: CUfunction,
}

// SAFETY: CUDA handles may be used from any thread.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Copy, Clone, Debug)]
pub struct LaunchConfig {
    pub grid: u32,
    pub block: u32,
    pub shared_bytes: u32,
}

type KernelSlot = Arc<OnceLock<std::result::Result<Kernel, Error>>>;
/// (context, source) -> instance -> slot: a call that finds its kernel
/// allocates nothing. An instance launches with one dynamic shared memory
/// size (a template argument of the Hopper kernels), set when it loads.
type KernelCache = Mutex<HashMap<(usize, &'static str), HashMap<String, KernelSlot>>>;

impl Kernel {
    /// The kernel `instance` (a template instantiation in `source`) for the
    /// context of `stream`: compiled for that device's architecture at first
    /// use (concurrent first callers wait for one load) and kept.
    pub fn get(stream: Stream, source: &'static Source, instance: &str) -> Result<Self> {
        Self::get_with_shared_bytes(stream, source, instance, 0)
    }

    /// [`Kernel::get`] for an instance that launches with `shared_bytes` of
    /// dynamic shared memory (beyond 48 KiB needs allowing, done at its load).
    pub fn get_with_shared_bytes(stream: Stream, source: &'static Source, instance: &str, shared_bytes: u32) -> Result<Self> {
        static CACHE: OnceLock<KernelCache> = OnceLock::new();
        let context = stream.context()?;
        let slot = {
            let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
            let instances = cache.entry((context as usize, source.name)).or_default();
            match instances.get(instance) {
                Some(slot) => slot.clone(),
                None => instances.entry(instance.to_owned()).or_default().clone(),
            }
        };
        slot.get_or_init(|| Self::load(context, source, instance, shared_bytes)).clone()
    }

    fn load(context: CUcontext, source: &'static Source, instance: &str, shared_bytes: u32) -> Result<Self> {
        let _current = ContextGuard::push(context)?;
        let arch = current_architecture()?;
        let cubin = cubin(source, instance, &arch)?;
        let mut module: CUmodule = std::ptr::null_mut();
        // SAFETY: a complete cubin image for this device's architecture.
        check("cuModuleLoadData", unsafe { sys::cuModuleLoadData(&mut module, cubin.image.as_ptr().cast()) })?;
        let mut function = std::ptr::null_mut();
        // SAFETY: the lowered name NVRTC gave for this instance. The module
        // stays loaded for the life of the process, like the kernel cache.
        check("cuModuleGetFunction", unsafe { sys::cuModuleGetFunction(&mut function, module, cubin.lowered_name.as_ptr()) })?;
        if shared_bytes > 0 {
            // SAFETY: a loaded function and a valid attribute.
            check("cuFuncSetAttribute", unsafe {
                sys::cuFuncSetAttribute(
                    function,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared_bytes as i32,
                )
            })?;
        }
        Ok(Self { context, function })
    }
}

/// An attribute of the current context's device.
fn device_attribute(which: CUdevice_attribute) -> Result<i32> {
    let mut device = 0;
    // SAFETY: a context is current.
    check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut device) })?;
    let mut value = 0;
    // SAFETY: a valid device and attribute.
    check("cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut value, which, device) })?;
    Ok(value)
}

/// The architecture of the current context's device.
fn current_architecture() -> Result<Architecture> {
    Ok(Architecture::of_compute_capability(
        device_attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        device_attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}

/// What the kernels' launch choices need to know of a device.
#[derive(Debug)]
pub struct Device {
    pub architecture: Architecture,
    pub multiprocessors: u32,
}

impl Stream {
    /// The stream's device, queried once per context and kept for the life of
    /// the process (like the kernel cache): a call that finds it allocates nothing.
    pub fn device(self) -> Result<&'static Device> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, &'static Device>>> = OnceLock::new();
        let context = self.context()?;
        let mut devices = DEVICES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        if let Some(device) = devices.get(&(context as usize)) {
            return Ok(device);
        }
        let _current = ContextGuard::push(context)?;
        let device: &'static Device = Box::leak(Box::new(Device {
            architecture: current_architecture()?,
            multiprocessors: device_attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
        }));
        devices.insert(context as usize, device);
        Ok(device)
    }

    fn context(self) -> Result<CUcontext> {
        init_driver()?;
        let mut context = std::ptr::null_mut();
        // SAFETY: `self` is XLA's live stream.
        check("cuStreamGetCtx", unsafe { sys::cuStreamGetCtx(self.raw, &mut context) })?;
        Ok(context)
    }
}

/// A TMA descriptor of a row-major tensor of 16- or 8-bit elements, loaded in
/// boxes with the 128-byte swizzle (what `wgmma` reads); passed to a kernel by value.
#[repr(transparent)]
pub struct TensorMap(sys::CUtensorMap);

impl TensorMap {
    /// A descriptor no kernel loads through: the slots of a launch's fixed
    /// array of maps that it does not use.
    pub fn unused() -> Self {
        Self(sys::CUtensorMap { opaque: [0; 16] })
    }

    /// `dims` and `box_dims` innermost first; rows must be multiples of 16
    /// bytes. Elements outside the tensor load as zero.
    pub fn tiled_16bit(address: u64, dims: &[u64], box_dims: &[u32]) -> Result<Self> {
        Self::tiled(sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, address, dims, box_dims)
    }

    /// The same for 8-bit elements (FP8 values).
    pub fn tiled_8bit(address: u64, dims: &[u64], box_dims: &[u32]) -> Result<Self> {
        Self::tiled(sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, address, dims, box_dims)
    }

    fn tiled(data_type: sys::CUtensorMapDataType, element_bytes: u64, address: u64, dims: &[u64], box_dims: &[u32]) -> Result<Self> {
        let mut strides = Vec::with_capacity(dims.len());
        let mut stride = element_bytes;
        for &dim in &dims[..dims.len() - 1] {
            stride *= dim;
            strides.push(stride);
        }
        let element_strides = vec![1u32; dims.len()];
        let mut map = sys::CUtensorMap { opaque: [0; 16] };
        // SAFETY: the arrays hold `dims.len()` (strides: one less) entries and
        // outlive the call; the address is a device buffer of that shape.
        check("cuTensorMapEncodeTiled", unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                data_type,
                dims.len() as u32,
                address as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                box_dims.as_ptr(),
                element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        })?;
        Ok(Self(map))
    }
}

/// Launches `kernel` on `stream` with `args` (pointers to each argument's
/// value, in the kernel's order). Asynchronous: nothing waits for it. At the
/// initialize stage (see [`Stream`]) it launches nothing.
pub fn launch(stream: Stream, kernel: Kernel, config: LaunchConfig, args: &mut [*mut c_void]) -> Result<()> {
    if config.grid == 0 || !stream.launches {
        return Ok(());
    }
    let _current = ContextGuard::push(kernel.context)?;
    // SAFETY: the argument pointers match the kernel's parameters (the caller's
    // contract) and stay valid for the call; the launch copies the values.
    check("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(
            kernel.function,
            config.grid,
            1,
            1,
            config.block,
            1,
            1,
            config.shared_bytes,
            stream.raw,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })
}

/// A pointer to a kernel argument's value, for [`launch`].
pub fn arg<T>(value: &T) -> *mut c_void {
    (value as *const T).cast_mut().cast()
}
