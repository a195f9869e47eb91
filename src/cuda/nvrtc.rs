//! Compiling kernels with NVRTC to cubins, cached in memory and on disk.

use super::{Source, HEADERS};
use crate::ffi::{DataType, Error, Result};
use crate::real::FLOAT_TYPES;
use cudarc::nvrtc::sys;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

/// A GPU architecture NVRTC compiles for, as NVRTC spells it (`sm_90a`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Architecture(pub String);

impl Architecture {
    /// The exact architecture of a device of compute capability `major.minor`:
    /// the architecture-specific variant (`sm_90a`, `sm_100a`) from Hopper on,
    /// whose features (wgmma, setmaxnreg) the portable one lacks.
    pub fn of_compute_capability(major: i32, minor: i32) -> Self {
        let suffix = if major >= 9 { "a" } else { "" };
        Self(format!("sm_{major}{minor}{suffix}"))
    }
}

/// A compiled kernel: the cubin and the mangled name of the instantiation.
pub struct Cubin {
    pub image: Vec<u8>,
    pub lowered_name: CString,
}

fn nvrtc_error(call: &str, result: sys::nvrtcResult) -> Error {
    // SAFETY: NVRTC returns a static string for every result code.
    let text = unsafe { CStr::from_ptr(sys::nvrtcGetErrorString(result)) }.to_string_lossy().into_owned();
    Error::internal(format!("{call} failed: {text}"))
}

fn check(call: &str, result: sys::nvrtcResult) -> Result<()> {
    if result == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(nvrtc_error(call, result))
    }
}

/// Checks NVRTC can be loaded, with an error that says how to provide it.
fn require_nvrtc() -> Result<()> {
    // SAFETY: only tries to open the library.
    if unsafe { sys::is_culib_present() } {
        return Ok(());
    }
    Err(Error::internal(
        "NVRTC (libnvrtc.so.13) could not be loaded: `import oxmoe` finds and loads it from the \
         nvidia-cuda-nvrtc wheel or a CUDA toolkit (see oxmoe._cuda), or put its folder on LD_LIBRARY_PATH",
    ))
}

/// `major.minor` of the loaded NVRTC.
fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: out-parameters.
    check("nvrtcVersion", unsafe { sys::nvrtcVersion(&mut major, &mut minor) })?;
    Ok((major, minor))
}

fn options(arch: &Architecture) -> Vec<String> {
    vec![format!("--gpu-architecture={}", arch.0), "-std=c++17".into(), "-default-device".into()]
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once.
        unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
    }
}

/// Compiles `source` for `arch`, instantiating every name expression (e.g.
/// `topk_fwd<bf16, 256, 8, 8, 4, 2, true, 128, 4>`); returns the cubin and the
/// lowered names in the order given. A compile error carries NVRTC's log.
fn compile_program(
    source: &Source,
    instances: &[&str],
    arch: &Architecture,
    extra_options: &[&str],
) -> Result<(Vec<u8>, Vec<CString>)> {
    require_nvrtc()?;
    let text = CString::new(source.text).map_err(|_| Error::internal("kernel source contains NUL"))?;
    let name = CString::new(source.name).expect("file names have no NUL");
    let header_texts: Vec<CString> = HEADERS.iter().map(|h| CString::new(h.text).expect("no NUL")).collect();
    let header_names: Vec<CString> = HEADERS.iter().map(|h| CString::new(h.name).expect("no NUL")).collect();
    let header_text_ptrs: Vec<*const c_char> = header_texts.iter().map(|h| h.as_ptr()).collect();
    let header_name_ptrs: Vec<*const c_char> = header_names.iter().map(|h| h.as_ptr()).collect();
    let mut raw = std::ptr::null_mut();
    // SAFETY: every pointer outlives the program (they live to the end of this function).
    check("nvrtcCreateProgram", unsafe {
        sys::nvrtcCreateProgram(
            &mut raw,
            text.as_ptr(),
            name.as_ptr(),
            HEADERS.len() as i32,
            header_text_ptrs.as_ptr(),
            header_name_ptrs.as_ptr(),
        )
    })?;
    let program = Program(raw);
    let expressions: Vec<CString> =
        instances.iter().map(|e| CString::new(*e).map_err(|_| Error::internal("NUL in a name expression"))).collect::<Result<_>>()?;
    for expression in &expressions {
        // SAFETY: a live program and a NUL-terminated expression.
        check("nvrtcAddNameExpression", unsafe { sys::nvrtcAddNameExpression(program.0, expression.as_ptr()) })?;
    }
    let options: Vec<CString> = options(arch)
        .into_iter()
        .chain(extra_options.iter().map(|&o| o.to_owned()))
        .map(|o| CString::new(o).expect("no NUL"))
        .collect();
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: a live program and valid option strings.
    let compiled = unsafe { sys::nvrtcCompileProgram(program.0, option_ptrs.len() as i32, option_ptrs.as_ptr()) };
    if compiled != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::internal(format!(
            "NVRTC could not compile kernels/{} for {} ({}):\n{}",
            source.name,
            arch.0,
            nvrtc_error("nvrtcCompileProgram", compiled).message(),
            program_log(&program)
        )));
    }
    let mut size = 0usize;
    // SAFETY: a compiled program.
    check("nvrtcGetCUBINSize", unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) })?;
    let mut image = vec![0u8; size];
    // SAFETY: `image` holds `size` bytes.
    check("nvrtcGetCUBIN", unsafe { sys::nvrtcGetCUBIN(program.0, image.as_mut_ptr().cast()) })?;
    let mut lowered = Vec::with_capacity(expressions.len());
    for expression in &expressions {
        let mut name = std::ptr::null();
        // SAFETY: the expression was added before compiling; the name lives with the program.
        check("nvrtcGetLoweredName", unsafe { sys::nvrtcGetLoweredName(program.0, expression.as_ptr(), &mut name) })?;
        // SAFETY: NVRTC returns a NUL-terminated name.
        lowered.push(unsafe { CStr::from_ptr(name) }.to_owned());
    }
    Ok((image, lowered))
}

fn program_log(program: &Program) -> String {
    let mut size = 0usize;
    // SAFETY: a live program.
    if unsafe { sys::nvrtcGetProgramLogSize(program.0, &mut size) } != sys::nvrtcResult::NVRTC_SUCCESS {
        return String::new();
    }
    let mut log = vec![0u8; size];
    // SAFETY: `log` holds `size` bytes.
    unsafe { sys::nvrtcGetProgramLog(program.0, log.as_mut_ptr().cast()) };
    String::from_utf8_lossy(&log).trim_end_matches('\0').to_owned()
}

/// Compiles every instance of `source` for `arch` in one program: the check CI
/// runs for every kernel and architecture, with no GPU. Unoptimised
/// (`--device-debug`): the same front end, and ptxas still checks every
/// instruction for the architecture, in half the CPU time (CI has two cores);
/// the optimised cubins are the ones the GPU tests build and run.
pub fn compile_check(source: &Source, instances: &[&str], arch: &Architecture) -> Result<()> {
    compile_program(source, instances, arch, &["--device-debug"]).map(|_| ())
}

/// [`compile_check`] of each `(architecture, instances)` pair, a thread each;
/// panics with the messages of the programs that failed. The kernel families'
/// CI tests: no GPU, but NVRTC.
pub fn assert_compiles(source: &Source, checks: &[(&str, &[String])]) {
    let failures: Vec<String> = std::thread::scope(|scope| {
        let runs: Vec<_> = checks
            .iter()
            .map(|&(arch, instances)| {
                scope.spawn(move || {
                    let instances: Vec<&str> = instances.iter().map(String::as_str).collect();
                    compile_check(source, &instances, &Architecture(arch.into()))
                })
            })
            .collect();
        runs.into_iter().filter_map(|run| run.join().unwrap().err()).map(|e| e.message().to_owned()).collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// [`assert_compiles`] of a kernel family whose instances `instances(dtypes)`
/// builds for the given element types: every type for Hopper (the GPU the
/// kernels are tuned and tested on), bf16 for Ampere and Blackwell. What
/// differs between the architectures is the kernels' `__CUDA_ARCH__` paths,
/// which bf16 takes as the other types do, at a third of the CPU time (CI has
/// two cores).
pub fn assert_family_compiles(source: &Source, instances: impl Fn(&[DataType]) -> Vec<String>) {
    let (all, bf16) = (instances(&FLOAT_TYPES), instances(&[DataType::BF16]));
    assert_compiles(source, &[("sm_80", &bf16), ("sm_90a", &all), ("sm_100", &bf16)]);
}

/// Where compiled kernels are kept between processes: `$OXMOE_CACHE_DIR`,
/// else `$XDG_CACHE_HOME/oxmoe/kernels`, else `~/.cache/oxmoe/kernels`.
fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("OXMOE_CACHE_DIR") {
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))?;
    Some(base.join("oxmoe").join("kernels"))
}

/// The cache key: everything the cubin depends on.
fn cache_key(source: &Source, instance: &str, arch: &Architecture, nvrtc: (i32, i32)) -> String {
    let mut hash = Sha256::new();
    for part in [source.name, source.text, instance, &arch.0, &format!("nvrtc {}.{}", nvrtc.0, nvrtc.1)] {
        hash.update(part.len().to_le_bytes());
        hash.update(part.as_bytes());
    }
    for header in &HEADERS {
        hash.update(header.text.as_bytes());
    }
    hash.update(options(arch).join(" ").as_bytes());
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// A cached cubin file: the lowered name, a newline, then the image.
fn read_cached(path: &std::path::Path) -> Option<Cubin> {
    let bytes = std::fs::read(path).ok()?;
    let newline = bytes.iter().position(|&b| b == b'\n')?;
    let lowered_name = CString::new(&bytes[..newline]).ok()?;
    Some(Cubin { image: bytes[newline + 1..].to_vec(), lowered_name })
}

fn write_cached(path: &std::path::Path, cubin: &Cubin) {
    // Write then rename, so a concurrent reader sees a whole file or none; a
    // cache that cannot be written only costs a recompile next time.
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let temporary = path.with_extension(format!("tmp{}", std::process::id()));
    let mut bytes = cubin.lowered_name.as_bytes().to_vec();
    bytes.push(b'\n');
    bytes.extend_from_slice(&cubin.image);
    if std::fs::write(&temporary, bytes).is_ok() && std::fs::rename(&temporary, path).is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
}

type CubinCache = Mutex<HashMap<(Architecture, &'static str, String), Arc<OnceLock<std::result::Result<Arc<Cubin>, Error>>>>>;

/// The cubin of one kernel instance for `arch`, compiled once per process
/// (concurrent first callers wait for the one compiling) and kept on disk.
pub fn cubin(source: &'static Source, instance: &str, arch: &Architecture) -> Result<Arc<Cubin>> {
    static CACHE: OnceLock<CubinCache> = OnceLock::new();
    let slot = {
        let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        cache.entry((arch.clone(), source.name, instance.to_owned())).or_default().clone()
    };
    slot.get_or_init(|| {
        require_nvrtc()?;
        let key = cache_key(source, instance, arch, nvrtc_version()?);
        let path = cache_dir().map(|dir| dir.join(format!("{key}.cubin")));
        if let Some(cubin) = path.as_deref().and_then(read_cached) {
            return Ok(Arc::new(cubin));
        }
        let (image, mut lowered) = compile_program(source, &[instance], arch, &[])?;
        let cubin = Cubin { image, lowered_name: lowered.remove(0) };
        if let Some(path) = &path {
            write_cached(path, &cubin);
        }
        Ok(Arc::new(cubin))
    })
    .clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::ROUTER;
    use crate::router::cuda::aux_loss_total_instance;

    /// Concurrent first calls for one kernel compile it once and share it; the
    /// cubin lands in the disk cache, whole, under its key.
    #[test]
    fn concurrent_first_calls_share_one_compiled_kernel_and_fill_the_disk_cache() {
        let dir = std::env::temp_dir().join(format!("oxmoe-cache-test-{}", std::process::id()));
        std::env::set_var("OXMOE_CACHE_DIR", &dir);
        let arch = Architecture("sm_90a".into());
        let total = aux_loss_total_instance().unwrap();
        let cubins: Vec<Arc<Cubin>> = std::thread::scope(|scope| {
            let calls: Vec<_> = (0..4).map(|_| scope.spawn(|| cubin(&ROUTER, &total, &arch))).collect();
            calls.into_iter().map(|c| c.join().unwrap().unwrap_or_else(|e| panic!("{}", e.message()))).collect()
        });
        assert!(cubins.iter().all(|c| Arc::ptr_eq(c, &cubins[0])), "one compile, shared");
        let key = cache_key(&ROUTER, &total, &arch, nvrtc_version().unwrap());
        let cached = read_cached(&dir.join(format!("{key}.cubin"))).expect("the cubin is in the disk cache");
        assert_eq!(cached.image, cubins[0].image);
        assert_eq!(cached.lowered_name, cubins[0].lowered_name);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_cache_key_changes_with_instance_and_architecture() {
        let key = |instance: &str, arch: &str| cache_key(&ROUTER, instance, &Architecture(arch.into()), (13, 0));
        assert_ne!(key("aux_loss_total", "sm_90a"), key("aux_loss_total", "sm_80"));
        assert_ne!(key("aux_loss_total", "sm_90a"), key("scores_bwd<float, 8, 0>", "sm_90a"));
        assert_eq!(key("aux_loss_total", "sm_90a"), key("aux_loss_total", "sm_90a"));
    }

    #[test]
    fn hopper_and_later_compile_for_the_architecture_specific_target() {
        assert_eq!(Architecture::of_compute_capability(9, 0).0, "sm_90a");
        assert_eq!(Architecture::of_compute_capability(10, 0).0, "sm_100a");
        assert_eq!(Architecture::of_compute_capability(8, 6).0, "sm_86");
    }
}
