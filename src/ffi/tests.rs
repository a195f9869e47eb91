//! Drives handlers through call frames built by hand, with a fake XLA API that
//! records the errors a handler creates.

use super::*;
use std::ffi::{c_void, CStr};
use xla_ffi_sys as sys;

/// Stands in for XLA's error: the code and message a handler returned.
struct FakeError {
    code: sys::XLA_FFI_Error_Code,
    message: String,
}

unsafe extern "C" fn fake_error_create(args: *mut sys::XLA_FFI_Error_Create_Args) -> *mut sys::XLA_FFI_Error {
    let args = &*args;
    let message = CStr::from_ptr(args.message).to_string_lossy().into_owned();
    Box::into_raw(Box::new(FakeError { code: args.errc, message })).cast()
}

fn fake_api() -> sys::XLA_FFI_Api {
    sys::XLA_FFI_Api { XLA_FFI_Error_Create: Some(fake_error_create), ..Default::default() }
}

fn take_error(error: *mut sys::XLA_FFI_Error) -> Option<FakeError> {
    (!error.is_null()).then(|| *unsafe { Box::from_raw(error.cast::<FakeError>()) })
}

fn buffer<T>(dtype: DataType, data: &mut [T], dims: &mut [i64]) -> sys::XLA_FFI_Buffer {
    sys::XLA_FFI_Buffer {
        struct_size: sys::XLA_FFI_Buffer_STRUCT_SIZE as usize,
        extension_start: std::ptr::null_mut(),
        dtype: dtype.0,
        data: data.as_mut_ptr().cast(),
        rank: dims.len() as i64,
        dims: dims.as_mut_ptr(),
    }
}

/// One attribute: its name and the scalar or string it points at.
enum AttrValue {
    I64(i64),
    F32(f32),
    Bool(u8),
    Str(&'static str),
}

/// Owns everything a call frame points into.
struct Frame {
    api: sys::XLA_FFI_Api,
    args: Vec<sys::XLA_FFI_Buffer>,
    rets: Vec<sys::XLA_FFI_Buffer>,
    attrs: Vec<(&'static str, AttrValue)>,
    stage: sys::XLA_FFI_ExecutionStage,
    extension: *mut sys::XLA_FFI_Extension_Base,
}

impl Frame {
    fn new(args: Vec<sys::XLA_FFI_Buffer>, rets: Vec<sys::XLA_FFI_Buffer>, attrs: Vec<(&'static str, AttrValue)>) -> Self {
        Self { api: fake_api(), args, rets, attrs, stage: sys::XLA_FFI_ExecutionStage_EXECUTE, extension: std::ptr::null_mut() }
    }

    /// Calls `handler` with this frame and returns the error it created, if any.
    fn call(&mut self, handler: unsafe extern "C" fn(*mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error) -> Option<FakeError> {
        let mut arg_types = vec![sys::XLA_FFI_ArgType_BUFFER; self.args.len()];
        let mut arg_ptrs: Vec<*mut c_void> = self.args.iter_mut().map(|b| (b as *mut sys::XLA_FFI_Buffer).cast()).collect();
        let mut ret_types = vec![sys::XLA_FFI_RetType_BUFFER; self.rets.len()];
        let mut ret_ptrs: Vec<*mut c_void> = self.rets.iter_mut().map(|b| (b as *mut sys::XLA_FFI_Buffer).cast()).collect();
        let mut scalars: Vec<sys::XLA_FFI_Scalar> = Vec::new();
        let mut spans: Vec<sys::XLA_FFI_ByteSpan> = Vec::new();
        let mut attr_types = Vec::new();
        for (_, value) in &mut self.attrs {
            let (kind, scalar) = match value {
                AttrValue::I64(v) => (sys::XLA_FFI_AttrType_SCALAR, Some((DataType::S64, (v as *mut i64).cast()))),
                AttrValue::F32(v) => (sys::XLA_FFI_AttrType_SCALAR, Some((DataType::F32, (v as *mut f32).cast()))),
                AttrValue::Bool(v) => (sys::XLA_FFI_AttrType_SCALAR, Some((DataType::PRED, (v as *mut u8).cast()))),
                AttrValue::Str(s) => {
                    spans.push(sys::XLA_FFI_ByteSpan { ptr: s.as_ptr().cast(), len: s.len() });
                    (sys::XLA_FFI_AttrType_STRING, None)
                }
            };
            if let Some((dtype, value)) = scalar {
                scalars.push(sys::XLA_FFI_Scalar { dtype: dtype.0, value });
            }
            attr_types.push(kind);
        }
        let (mut next_scalar, mut next_span) = (scalars.iter_mut(), spans.iter_mut());
        let mut attr_ptrs: Vec<*mut c_void> = attr_types
            .iter()
            .map(|&kind| match kind {
                sys::XLA_FFI_AttrType_SCALAR => (next_scalar.next().unwrap() as *mut sys::XLA_FFI_Scalar).cast(),
                _ => (next_span.next().unwrap() as *mut sys::XLA_FFI_ByteSpan).cast(),
            })
            .collect();
        let mut names: Vec<sys::XLA_FFI_ByteSpan> =
            self.attrs.iter().map(|(n, _)| sys::XLA_FFI_ByteSpan { ptr: n.as_ptr().cast(), len: n.len() }).collect();
        let mut name_ptrs: Vec<*mut sys::XLA_FFI_ByteSpan> = names.iter_mut().map(|n| n as *mut _).collect();
        let mut frame = sys::XLA_FFI_CallFrame {
            struct_size: sys::XLA_FFI_CallFrame_STRUCT_SIZE as usize,
            extension_start: self.extension,
            api: &self.api,
            ctx: std::ptr::null_mut(),
            stage: self.stage,
            args: sys::XLA_FFI_Args {
                struct_size: sys::XLA_FFI_Args_STRUCT_SIZE as usize,
                extension_start: std::ptr::null_mut(),
                size: arg_ptrs.len() as i64,
                types: arg_types.as_mut_ptr(),
                args: arg_ptrs.as_mut_ptr(),
            },
            rets: sys::XLA_FFI_Rets {
                struct_size: sys::XLA_FFI_Rets_STRUCT_SIZE as usize,
                extension_start: std::ptr::null_mut(),
                size: ret_ptrs.len() as i64,
                types: ret_types.as_mut_ptr(),
                rets: ret_ptrs.as_mut_ptr(),
            },
            attrs: sys::XLA_FFI_Attrs {
                struct_size: sys::XLA_FFI_Attrs_STRUCT_SIZE as usize,
                extension_start: std::ptr::null_mut(),
                size: attr_ptrs.len() as i64,
                types: attr_types.as_mut_ptr(),
                names: name_ptrs.as_mut_ptr(),
                attrs: attr_ptrs.as_mut_ptr(),
            },
            future: std::ptr::null_mut(),
        };
        take_error(unsafe { handler(&mut frame) })
    }
}

fn topk_attrs(topk: i64, score_function: &'static str) -> Vec<(&'static str, AttrValue)> {
    vec![
        ("group_topk", AttrValue::I64(1)),
        ("num_groups", AttrValue::I64(1)),
        ("scaling_factor", AttrValue::F32(1.0)),
        ("score_function", AttrValue::Str(score_function)),
        ("topk", AttrValue::I64(topk)),
        ("use_pre_softmax", AttrValue::Bool(0)),
    ]
}

type Handler = unsafe extern "C" fn(*mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error;

/// Runs `oxmoe_topk_fwd` on `logits [2, 4]` with the given attributes.
fn run_topk(logits_dtype: DataType, attrs: Vec<(&'static str, AttrValue)>) -> (Option<FakeError>, Vec<f32>, Vec<u8>) {
    let mut logits = vec![0.5f32, 2.0, 1.0, 2.0, -1.0, 0.0, 3.0, 1.0];
    let (mut probs, mut map) = (vec![f32::NAN; 8], vec![7u8; 8]);
    let (mut d0, mut d1, mut d2) = ([2i64, 4], [2i64, 4], [2i64, 4]);
    let mut frame = Frame::new(
        vec![buffer(logits_dtype, &mut logits, &mut d0)],
        vec![buffer(DataType::F32, &mut probs, &mut d1), buffer(DataType::PRED, &mut map, &mut d2)],
        attrs,
    );
    let error = frame.call(crate::router::handlers::oxmoe_topk_fwd as Handler);
    (error, probs, map)
}

#[test]
fn handler_computes_through_a_call_frame() {
    let (error, probs, map) = run_topk(DataType::F32, topk_attrs(2, "softmax"));
    assert!(error.is_none(), "{}", error.unwrap().message);
    // Row 0 ties experts 1 and 3 (logit 2.0): both chosen, equal weights.
    assert_eq!(map, [0, 1, 0, 1, 0, 0, 1, 1]);
    assert_eq!(&probs[..4], &[0.0, 0.5, 0.0, 0.5]);
    let e = (1.0f32 - 3.0).exp();
    assert!((probs[6] - 1.0 / (1.0 + e)).abs() < 1e-6 && (probs[7] - e / (1.0 + e)).abs() < 1e-6);
}

#[test]
fn wrong_dtype_is_an_error_naming_the_handler_and_argument() {
    let (error, ..) = run_topk(DataType::S32, topk_attrs(2, "softmax"));
    let error = error.expect("int32 logits must be refused");
    assert_eq!(error.code, sys::XLA_FFI_Error_Code_INVALID_ARGUMENT);
    assert_eq!(error.message, "oxmoe_topk_fwd: logits has dtype int32, expected float32 or bfloat16 or float16");
}

#[test]
fn bad_attributes_are_errors() {
    let (error, ..) = run_topk(DataType::F32, topk_attrs(5, "softmax"));
    assert!(error.unwrap().message.contains("topk is 5, expected 1 <= topk <= num_experts (4)"));
    let (error, ..) = run_topk(DataType::F32, topk_attrs(2, "relu"));
    assert!(error.unwrap().message.contains("score_function is \"relu\""));
    let mut attrs = topk_attrs(2, "softmax");
    attrs.retain(|(name, _)| *name != "scaling_factor");
    let (error, ..) = run_topk(DataType::F32, attrs);
    assert!(error.unwrap().message.contains("attribute `scaling_factor` (a float32) is missing"));
    let mut attrs = topk_attrs(2, "softmax");
    attrs[2] = ("scaling_factor", AttrValue::I64(1));
    let (error, ..) = run_topk(DataType::F32, attrs);
    assert!(error.unwrap().message.contains("attribute `scaling_factor` has type int64, expected a float32"));
}

#[test]
fn result_of_the_wrong_shape_is_an_error() {
    let mut logits = vec![0.0f32; 8];
    let (mut probs, mut map) = (vec![0.0f32; 6], vec![0u8; 8]);
    let (mut d0, mut d1, mut d2) = ([2i64, 4], [2i64, 3], [2i64, 4]);
    let mut frame = Frame::new(
        vec![buffer(DataType::F32, &mut logits, &mut d0)],
        vec![buffer(DataType::F32, &mut probs, &mut d1), buffer(DataType::PRED, &mut map, &mut d2)],
        topk_attrs(1, "softmax"),
    );
    let error = frame.call(crate::router::handlers::oxmoe_topk_fwd as Handler).unwrap();
    assert_eq!(error.message, "oxmoe_topk_fwd: probs has shape float32[2, 3], expected [2, 4]");
}

/// What `handler` answers XLA's metadata query with.
fn metadata_of(handler: Handler) -> sys::XLA_FFI_Metadata {
    let mut metadata = sys::XLA_FFI_Metadata { struct_size: sys::XLA_FFI_Metadata_STRUCT_SIZE as usize, ..Default::default() };
    let mut extension = sys::XLA_FFI_Metadata_Extension {
        extension_base: sys::XLA_FFI_Extension_Base {
            struct_size: sys::XLA_FFI_Metadata_Extension_STRUCT_SIZE as usize,
            type_: sys::XLA_FFI_Extension_Metadata,
            next: std::ptr::null_mut(),
        },
        metadata: &mut metadata,
    };
    let mut frame = Frame::new(vec![], vec![], vec![]);
    frame.extension = (&mut extension as *mut sys::XLA_FFI_Metadata_Extension).cast();
    assert!(frame.call(handler).is_none());
    metadata
}

#[test]
fn metadata_query_reports_api_version_and_traits() {
    let metadata = metadata_of(crate::router::handlers::oxmoe_topk_fwd);
    assert_eq!((metadata.api_version.major_version, metadata.api_version.minor_version), (0, 3));
    assert_eq!(metadata.traits, 0);
    // A CUDA handler may be captured in a CUDA graph.
    let metadata = metadata_of(crate::router::handlers::oxmoe_topk_fwd_cuda);
    assert_eq!(metadata.traits, sys::XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
}

#[test]
fn other_stages_are_refused() {
    // A CPU handler runs at the execute stage only; a CUDA handler at initialize too.
    for (stage, handler) in [
        (sys::XLA_FFI_ExecutionStage_PREPARE, crate::router::handlers::oxmoe_topk_fwd as Handler),
        (sys::XLA_FFI_ExecutionStage_INITIALIZE, crate::router::handlers::oxmoe_topk_fwd),
        (sys::XLA_FFI_ExecutionStage_PREPARE, crate::router::handlers::oxmoe_topk_fwd_cuda),
    ] {
        let mut frame = Frame::new(vec![], vec![], vec![]);
        frame.stage = stage;
        let error = frame.call(handler).unwrap();
        assert!(error.message.contains(&format!("called at execution stage {stage}")), "{}", error.message);
    }
}

/// A handler of one float32 result `[n]` and nothing else.
struct OneResult;

impl OneResult {
    fn decode(call: &Call) -> Result<Self> {
        call.ret(0, "out")?.expect_dtype(&[DataType::F32])?;
        Ok(Self)
    }
}

crate::export_handler!(oxmoe_test_panics, OneResult, |_, _| panic!("deliberate"));

/// Calls `handler` with one float32 result of `n` elements.
fn call_with_one_result(handler: Handler, n: usize) -> Option<FakeError> {
    let (mut out, mut dims) = (vec![0.0f32; n], [n as i64]);
    Frame::new(vec![], vec![buffer(DataType::F32, &mut out, &mut dims)], vec![]).call(handler)
}

#[test]
fn a_panic_becomes_an_internal_error() {
    let error = call_with_one_result(oxmoe_test_panics, 3).unwrap();
    assert_eq!(error.code, sys::XLA_FFI_Error_Code_INTERNAL);
    assert_eq!(error.message, "oxmoe_test_panics: internal error (panic): deliberate");
}

#[test]
fn a_call_whose_results_hold_no_element_runs_nothing() {
    assert!(call_with_one_result(oxmoe_test_panics, 0).is_none(), "the handler ran");
}

#[test]
fn a_result_the_handler_does_not_write_is_an_error() {
    let mut logits = vec![0.5f32; 8];
    let (mut probs, mut map, mut extra) = (vec![0.0f32; 8], vec![0u8; 8], vec![f32::NAN; 8]);
    let (mut d0, mut d1, mut d2, mut d3) = ([2i64, 4], [2i64, 4], [2i64, 4], [2i64, 4]);
    let mut frame = Frame::new(
        vec![buffer(DataType::F32, &mut logits, &mut d0)],
        vec![
            buffer(DataType::F32, &mut probs, &mut d1),
            buffer(DataType::PRED, &mut map, &mut d2),
            buffer(DataType::F32, &mut extra, &mut d3),
        ],
        topk_attrs(2, "softmax"),
    );
    let error = frame.call(crate::router::handlers::oxmoe_topk_fwd as Handler).unwrap();
    assert_eq!(error.message, "oxmoe_topk_fwd: the call has 3 results, expected 2");
    assert!(map.iter().all(|&m| m == 0), "the handler computed before refusing");
}

#[test]
fn an_unknown_attribute_is_an_error_naming_it() {
    let mut attrs = topk_attrs(2, "softmax");
    attrs.push(("bogus_attr", AttrValue::I64(7)));
    let (error, _, map) = run_topk(DataType::F32, attrs);
    assert_eq!(error.unwrap().message, "oxmoe_topk_fwd: unknown attribute `bogus_attr`");
    assert_eq!(map, [7; 8], "the handler computed before refusing");
    let mut attrs = topk_attrs(2, "softmax");
    attrs.push(("alpha", AttrValue::F32(1.0)));
    attrs.push(("beta", AttrValue::Str("x")));
    let (error, ..) = run_topk(DataType::F32, attrs);
    assert_eq!(error.unwrap().message, "oxmoe_topk_fwd: unknown attributes `alpha`, `beta`");
}

/// A copy of `buffer` with the same data: what `input_output_aliases` hands a handler.
fn alias(buffer: &sys::XLA_FFI_Buffer) -> sys::XLA_FFI_Buffer {
    sys::XLA_FFI_Buffer { ..*buffer }
}

#[test]
fn a_result_sharing_memory_with_an_argument_is_refused() {
    // ragged_dot with lhs [2, 4] and out [2, 4] in the same memory (K = N = 4).
    let mut lhs: Vec<f32> = (0..8).map(|x| x as f32).collect();
    let mut rhs = vec![1.0f32; 16];
    let (mut sizes, mut offset) = (vec![2i32], vec![0i32]);
    let (mut d0, mut d1, mut d2, mut d3) = ([2i64, 4], [1i64, 4, 4], [1i64], [1i64]);
    let lhs_buffer = buffer(DataType::F32, &mut lhs, &mut d0);
    let out_buffer = alias(&lhs_buffer);
    let mut workspace = vec![0u8; crate::grouped_gemm::handlers::oxmoe_grouped_gemm_workspace_bytes(1, 1) as usize];
    let mut d4 = [workspace.len() as i64];
    let mut frame = Frame::new(
        vec![
            lhs_buffer,
            buffer(DataType::F32, &mut rhs, &mut d1),
            buffer(DataType::S32, &mut sizes, &mut d2),
            buffer(DataType::S32, &mut offset, &mut d3),
        ],
        vec![out_buffer, buffer(DataType::U8, &mut workspace, &mut d4)],
        vec![("rhs_transposed", AttrValue::Bool(0))],
    );
    let error = frame.call(crate::grouped_gemm::handlers::oxmoe_ragged_dot as Handler).unwrap();
    assert_eq!(
        error.message,
        "oxmoe_ragged_dot: result 0 shares memory with argument 0: oxmoe handlers do not compute in place (no input_output_aliases)"
    );
    assert_eq!(lhs, (0..8).map(|x| x as f32).collect::<Vec<_>>());
}

#[test]
fn a_buffer_claiming_more_bytes_than_memory_holds_is_refused() {
    let mut logits = vec![0.0f32; 8];
    let (mut probs, mut map) = (vec![0.0f32; 8], vec![0u8; 8]);
    let huge = 1i64 << 40;
    let (mut d0, mut d1, mut d2) = ([huge, huge], [huge, huge], [huge, huge]);
    let mut frame = Frame::new(
        vec![buffer(DataType::F32, &mut logits, &mut d0)],
        vec![buffer(DataType::F32, &mut probs, &mut d1), buffer(DataType::PRED, &mut map, &mut d2)],
        topk_attrs(1, "softmax"),
    );
    let error = frame.call(crate::router::handlers::oxmoe_topk_fwd as Handler).unwrap();
    assert_eq!(
        error.message,
        "oxmoe_topk_fwd: logits has shape float32[1099511627776, 1099511627776]: more bytes than any buffer can hold"
    );
}

/// Runs `oxmoe_dispatch_fwd` on 3 tokens of 2 elements and a `[3, experts]`
/// routing map with every entry set, room for every copy, the given `align_size`.
fn run_dispatch(experts: usize, align_size: i64) -> Option<FakeError> {
    let (t, h) = (3usize, 2usize);
    let rows = t * experts;
    let mut tokens = vec![1.0f32; t * h];
    let mut map = vec![1u8; t * experts];
    let (mut out, mut dest, mut source) = (vec![0.0f32; rows * h], vec![0i32; t * experts], vec![0i32; rows]);
    let (mut per_expert, mut real, mut pads) = (vec![0i32; experts], vec![0i32; experts], vec![0i32; experts]);
    let (e, r) = (experts as i64, rows as i64);
    let (mut d0, mut d1, mut d2, mut d3, mut d4) = ([t as i64, h as i64], [t as i64, e], [r, h as i64], [t as i64, e], [r]);
    let (mut d5, mut d6, mut d7) = ([e], [e], [e]);
    let mut workspace = vec![0u8; crate::permutation::handlers::oxmoe_dispatch_fwd_workspace_bytes(t as u64, e as u64) as usize];
    let mut d8 = [workspace.len() as i64];
    let mut frame = Frame::new(
        vec![buffer(DataType::F32, &mut tokens, &mut d0), buffer(DataType::PRED, &mut map, &mut d1)],
        vec![
            buffer(DataType::F32, &mut out, &mut d2),
            buffer(DataType::S32, &mut dest, &mut d3),
            buffer(DataType::S32, &mut source, &mut d4),
            buffer(DataType::S32, &mut per_expert, &mut d5),
            buffer(DataType::S32, &mut real, &mut d6),
            buffer(DataType::S32, &mut pads, &mut d7),
            buffer(DataType::U8, &mut workspace, &mut d8),
        ],
        vec![("align_size", AttrValue::I64(align_size))],
    );
    frame.call(crate::permutation::handlers::oxmoe_dispatch_fwd as Handler)
}

#[test]
fn dispatch_refuses_sizes_that_would_wrap_its_offsets_and_no_experts() {
    assert!(run_dispatch(2, 4).is_none());
    let error = run_dispatch(2, 1 << 62).unwrap();
    assert_eq!(
        error.message,
        "oxmoe_dispatch_fwd: align_size is 4611686018427387904, expected 1 <= align_size <= 2147483647 (row indices are int32)"
    );
    let error = run_dispatch(0, 1).unwrap();
    assert_eq!(error.message, "oxmoe_dispatch_fwd: routing_map has shape [3, 0]: no experts, expected at least 1");
}

/// The test binary runs this case again in a child process (see the next
/// test), where a panic must print nothing, on the handler's thread or on a
/// rayon worker, while the message still travels in the error.
#[test]
fn panicking_child() {
    if std::env::var_os("OXMOE_PANIC_CHILD").is_none() {
        return;
    }
    let error = call_with_one_result(oxmoe_test_panics, 3).unwrap();
    assert_eq!(error.message, "oxmoe_test_panics: internal error (panic): deliberate");
    let error = call_with_one_result(oxmoe_test_panics_in_parallel, 3).unwrap();
    assert_eq!(error.message, "oxmoe_test_panics_in_parallel: internal error (panic): deliberate, in parallel");
    // A panic outside any handler still reaches the hook that was there before.
    let outside = std::panic::catch_unwind(|| panic!("outside a handler"));
    assert!(outside.is_err());
}

crate::export_handler!(oxmoe_test_panics_in_parallel, OneResult, |_, _| {
    use rayon::prelude::*;
    (0..64).into_par_iter().for_each(|i| {
        if i == 37 {
            panic!("deliberate, in parallel")
        }
    });
    Ok(())
});

#[test]
fn a_caught_panic_prints_nothing() {
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "ffi::tests::panicking_child", "--nocapture", "--test-threads=1"])
        .env("OXMOE_PANIC_CHILD", "1")
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&child.stderr);
    assert!(child.status.success(), "the child failed: {stderr}");
    assert!(!stderr.contains("deliberate"), "a caught panic printed: {stderr}");
    assert!(stderr.contains("outside a handler"), "the previous hook no longer runs: {stderr}");
}

#[test]
fn no_experts_is_an_error_not_a_panic() {
    let (mut grad, mut logits, mut out) = (vec![0.0f32; 0], vec![0.0f32; 0], vec![0.0f32; 0]);
    let (mut d0, mut d1, mut d2) = ([3i64, 0], [3i64, 0], [3i64, 0]);
    let mut frame = Frame::new(
        vec![buffer(DataType::F32, &mut grad, &mut d0), buffer(DataType::F32, &mut logits, &mut d1)],
        vec![buffer(DataType::F32, &mut out, &mut d2)],
        vec![("score_function", AttrValue::Str("softmax"))],
    );
    let error = frame.call(crate::router::handlers::oxmoe_aux_loss_scores_bwd as Handler).unwrap();
    assert_eq!(error.message, "oxmoe_aux_loss_scores_bwd: logits has shape [3, 0]: no experts, expected at least 1");
}
