//! CUDA implementations of the grouped products: which kernel of
//! `kernels/grouped_gemm.cu` a call takes, its specialisation and launch.
//!
//! On Hopper (sm_90a), 16-bit products whose rows are multiples of 16 bytes
//! (K and N multiples of 8, as TMA needs) run on the persistent TMA + wgmma
//! kernels, one block per multiprocessor; every other call takes the SIMT
//! kernels, after a one-warp launch that computes the window's row bounds.

use super::ops::{Fp8RaggedDot, Fp8TransposedRaggedDot, MAX_CHUNKS};
use super::{GroupedShape, RaggedDot, RaggedDotActivation, TransposedRaggedDot};
use crate::activation::{self, Activation};
use crate::cuda::{arg, grid, int, launch, Device, Instance, Kernel, LaunchConfig, Stream, TensorMap, GROUPED_GEMM};
use crate::ffi::{DataType, Result};
use std::ffi::c_void;

// Each kernel takes the constants of its launch below as template arguments
// (see `kernels/grouped_gemm.cu`), and checks they are the ones it is laid
// out for.

/// Threads of the Hopper kernels and of the SIMT kernels.
const HOPPER_THREADS: u32 = 384;
const SIMT_THREADS: u32 = 256;
/// Output tile edge of the SIMT kernels.
const SIMT_TILE: usize = 64;
/// Rows of a Hopper tile, and the contraction of one stage (the kernels'
/// `BLOCK_M`, `BLOCK_K`): the boxes of the tensor maps.
const BLOCK_M: u32 = 128;
const BLOCK_K: u32 = 64;
/// The Hopper kernels keep each local group's bounds in shared memory.
const MAX_LOCAL_GROUPS: usize = 1024;

/// The output columns of a Hopper tile for `n` columns: 256 unless that
/// leaves most of the last tile empty.
pub fn block_n(n: usize) -> u32 {
    if n <= 128 || (!n.is_multiple_of(256) && n % 256 <= 128) {
        128
    } else {
        256
    }
}

/// Stages of a Hopper kernel's ring for `block_n` columns: as many as fit
/// the 227 KiB of a block beside the output rows and the group tables.
fn hopper_stages(block_n: u32) -> u32 {
    if block_n == 256 {
        3
    } else {
        5
    }
}

/// Dynamic shared memory of a Hopper kernel with `block_n` columns: the
/// alignment slack, the stages, the output rows, the barriers and the group
/// tables (the kernel checks its `HopperConfig::SHARED_BYTES` is this).
fn hopper_shared_bytes(block_n: u32) -> u32 {
    let stages = hopper_stages(block_n);
    let stage = (BLOCK_M * BLOCK_K + BLOCK_K * block_n) * 2;
    let out_rows = 2 * 64 * (block_n + 8) * 2;
    1024 + stages * stage + out_rows + 2 * stages * 8 + 2 * (MAX_LOCAL_GROUPS as u32 + 1) * 4
}

/// Stages of the FP8 Hopper kernel's ring: 128-deep blocks of 128 x 128 bytes
/// of each operand, as many as fit beside its 128-column output rows.
const FP8_HOPPER_STAGES: u32 = 5;
/// Output columns of an FP8 Hopper tile, and the depth of its stages.
const FP8_BLOCK: u32 = 128;

/// An FP8 Hopper kernel's dynamic shared memory (its `Fp8HopperConfig::SHARED_BYTES`),
/// with group tables of `max_local_groups` (none for the weight gradient) and
/// `scale_bytes` of scales a stage (the weight gradient's, else none).
fn fp8_hopper_shared_bytes(max_local_groups: usize, scale_bytes: u32) -> u32 {
    let stage = (BLOCK_M + FP8_BLOCK) * FP8_BLOCK;
    let out_rows = 2 * 64 * (FP8_BLOCK + 8) * 2;
    1024 + FP8_HOPPER_STAGES * (stage + scale_bytes) + out_rows + 2 * FP8_HOPPER_STAGES * 8
        + 2 * (max_local_groups as u32 + 1) * 4
}

/// The tensor map a Hopper kernel stores its 16-bit output `[rows, n]`
/// through, in 64 x 64 boxes (`store_tile_in_bulk`); float32 outputs are
/// stored from registers and have none.
fn out_map(dtype: DataType, out: u64, n: u64, rows: u64) -> Result<TensorMap> {
    match dtype {
        DataType::F32 => Ok(TensorMap::unused()),
        _ => TensorMap::tiled_16bit(out, &[n, rows], &[64, 64]),
    }
}

/// The rows of a transposed product's output, its local groups' `[k, n]`
/// matrices one after the other, as its Hopper kernels address them (int
/// row coordinates).
fn transposed_out_rows(shape: &GroupedShape) -> Result<u64> {
    Ok(int(shape.local_groups * shape.k)? as u64)
}

/// The FP8 weight gradient's stages carry their block's scales of the tile's
/// 128 rows and 128 columns (float32).
const FP8_TRANSPOSED_SCALE_BYTES: u32 = 2 * FP8_BLOCK * 4;

/// Whether a product of `shape` can take a Hopper kernel on `device`: an
/// sm_90a GPU, a contraction, and local groups that the kernels' tables hold
/// (at least one: a tensor map has no dimension of 0).
fn on_hopper(device: &Device, shape: &GroupedShape) -> bool {
    shape.k > 0 && (1..=MAX_LOCAL_GROUPS).contains(&shape.local_groups) && device.architecture.0 == "sm_90a"
}

/// Whether a 16-bit product takes the Hopper kernels: rows of multiples of 16
/// bytes, as TMA needs (FP8 operands are multiples of 128 anyway).
fn takes_hopper(device: &Device, dtype: DataType, shape: &GroupedShape) -> bool {
    let sixteen_bit = matches!(dtype, DataType::BF16 | DataType::F16);
    sixteen_bit && shape.k.is_multiple_of(8) && shape.n.is_multiple_of(8) && on_hopper(device, shape)
}

/// Launches a Hopper kernel (block `block_n` columns wide, in clusters of
/// `cluster` blocks) with `args` (pointers to the kernel's arguments, in order).
fn launch_hopper(stream: Stream, device: &Device, instance: &str, block_n: u32, cluster: u32,
                 args: &mut [*mut c_void]) -> Result<()> {
    launch_persistent(stream, device, instance, hopper_shared_bytes(block_n), cluster, args)
}

/// Launches a persistent Hopper kernel, one block per multiprocessor (as many
/// as make whole clusters of `cluster`), with `shared` bytes of dynamic shared
/// memory.
fn launch_persistent(stream: Stream, device: &Device, instance: &str, shared: u32, cluster: u32,
                     args: &mut [*mut c_void]) -> Result<()> {
    let kernel = Kernel::get_with_shared_bytes(stream, &GROUPED_GEMM, instance, shared)?;
    let grid = device.multiprocessors / cluster * cluster;
    launch(stream, kernel, LaunchConfig { grid, block: HOPPER_THREADS, shared_bytes: shared }, args)
}

/// The blocks of a Hopper product's cluster for `n` columns in tiles of `width`:
/// two, sharing each A tile (half the A loads from L2), when the tiles pair
/// up; else one.
fn hopper_cluster(device: &Device, n: usize, width: u32) -> u32 {
    if n.div_ceil(width as usize).is_multiple_of(2) && device.multiprocessors >= 2 { 2 } else { 1 }
}

/// The rows of the boxes a Hopper product loads its A tiles in: each block
/// of a cluster loads its share of a tile's rows for all of them.
fn a_box_rows(cluster: u32) -> u32 {
    BLOCK_M / cluster
}

/// `activation`: ragged_dot_activation's, applied in the epilogue.
pub fn ragged_dot_hopper_instance(dtype: DataType, out: DataType, rhs_transposed: bool, cluster: u32,
                                  activation: Option<Activation>, block_n: u32) -> Result<String> {
    let instance = Instance::new("ragged_dot_hopper").dtype(dtype).dtype(out).flag(rhs_transposed).int(cluster);
    hopper_instance(instance.int(activation.map_or(0, Activation::code)), block_n)
}

pub fn transposed_hopper_instance(dtype: DataType, out: DataType, block_n: u32) -> Result<String> {
    hopper_instance(Instance::new("transposed_ragged_dot_hopper").dtype(dtype).dtype(out), block_n)
}

/// A Hopper kernel's instance: its own arguments, then its tile width and
/// the launch [`launch_hopper`] makes.
fn hopper_instance(instance: Instance, block_n: u32) -> Result<String> {
    let instance = instance.int(block_n).int(hopper_stages(block_n)).int(MAX_LOCAL_GROUPS);
    instance.int(HOPPER_THREADS).int(hopper_shared_bytes(block_n)).build()
}

pub fn fp8_ragged_dot_hopper_instance(out: DataType, cluster: u32) -> Result<String> {
    let instance = Instance::new("fp8_ragged_dot_hopper").dtype(out).int(cluster).int(FP8_HOPPER_STAGES);
    instance.int(MAX_LOCAL_GROUPS).int(HOPPER_THREADS).int(fp8_hopper_shared_bytes(MAX_LOCAL_GROUPS, 0)).build()
}

/// `rhs_block_columns`: the columns of rhs that share a scale (1, or 128).
pub fn fp8_transposed_hopper_instance(out: DataType, rhs_block_columns: usize, cluster: u32) -> Result<String> {
    let instance = Instance::new("fp8_transposed_ragged_dot_hopper").dtype(out).int(rhs_block_columns);
    let instance = instance.int(cluster).int(FP8_HOPPER_STAGES);
    instance.int(HOPPER_THREADS).int(fp8_hopper_shared_bytes(0, FP8_TRANSPOSED_SCALE_BYTES)).build()
}

pub fn ragged_dot_simt_instance(dtype: DataType, out: DataType, rhs_transposed: bool) -> Result<String> {
    let instance = Instance::new("ragged_dot_simt").dtype(dtype).dtype(out).flag(rhs_transposed);
    instance.int(SIMT_THREADS).int(SIMT_TILE).build()
}

pub fn transposed_simt_instance(dtype: DataType, out: DataType) -> Result<String> {
    Instance::new("transposed_ragged_dot_simt").dtype(dtype).dtype(out).int(SIMT_THREADS).int(SIMT_TILE).build()
}

pub fn fp8_ragged_dot_simt_instance(out: DataType, rhs_transposed: bool) -> Result<String> {
    Instance::new("fp8_ragged_dot_simt").dtype(out).flag(rhs_transposed).int(SIMT_THREADS).int(SIMT_TILE).build()
}

pub fn fp8_transposed_simt_instance(out: DataType, rhs_block_columns: usize) -> Result<String> {
    let instance = Instance::new("fp8_transposed_ragged_dot_simt").dtype(out).int(rhs_block_columns);
    instance.int(SIMT_THREADS).int(SIMT_TILE).build()
}

/// The group arguments and sizes the ragged_dot kernels take after their
/// operands, as they take them.
struct Groups {
    sizes: u64,
    offset: u64,
    groups: i32,
    local_groups: i32,
    /// `[m, k, n]` of the shape.
    dims: [i32; 3],
}

impl Groups {
    fn of(shape: &GroupedShape, sizes: u64, offset: u64) -> Result<Self> {
        Ok(Self {
            sizes,
            offset,
            groups: int(shape.groups)?,
            local_groups: int(shape.local_groups)?,
            dims: [int(shape.m)?, int(shape.k)?, int(shape.n)?],
        })
    }
}

/// Each chunk's row bounds of the window's groups (`group_bounds` launched
/// once per chunk, on chunk `c`'s sizes `sizes[c]` and rows `rows[c]`), in the
/// call's workspace (laid out as [`super::ops::workspace_bytes`] counts): the
/// kernels' `ChunkBounds`.
fn chunk_bounds(stream: Stream, shape: &GroupedShape, sizes: u64, offset: u64, rows: &[usize], workspace: u64) -> Result<ChunkBounds> {
    let (groups, local_groups) = (int(shape.groups)?, int(shape.local_groups)?);
    let per_chunk = shape.local_groups + 1;
    let kernel = Kernel::get(stream, &GROUPED_GEMM, "group_bounds")?;
    for (c, &m) in rows.iter().enumerate() {
        let chunk_sizes = sizes + (c * shape.groups * 4) as u64;
        let bounds = workspace + (c * per_chunk * 4) as u64;
        let m = int(m)?;
        launch(stream, kernel, LaunchConfig { grid: 1, block: 32, shared_bytes: 0 }, &mut [
            arg(&chunk_sizes), arg(&groups), arg(&offset), arg(&local_groups), arg(&m), arg(&bounds),
        ])?;
    }
    Ok(ChunkBounds { bounds: workspace, local_groups })
}

/// The kernels' `ChunkBounds`: each chunk's `local_groups + 1` row bounds.
#[repr(C)]
struct ChunkBounds {
    bounds: u64,
    local_groups: i32,
}

/// The kernels' `ChunkOperands`: each chunk's lhs and rhs (null past the chunks).
#[repr(C)]
struct ChunkOperands {
    lhs: [u64; MAX_CHUNKS],
    rhs: [u64; MAX_CHUNKS],
}

/// The Hopper kernel's `ChunkMaps`: each chunk's lhs and rhs tensor maps.
#[repr(C)]
struct ChunkMaps {
    lhs: [TensorMap; MAX_CHUNKS],
    rhs: [TensorMap; MAX_CHUNKS],
}

pub fn ragged_dot(stream: Stream, a: &RaggedDot) -> Result<()> {
    let Some(g) = writes_something(a)? else { return Ok(()) };
    plain_product(stream, stream.device()?, a, &g)
}

/// The product alone (no epilogue): on the Hopper kernel when it takes the
/// tensor cores, else on the SIMT kernel.
fn plain_product(stream: Stream, device: &Device, a: &RaggedDot, g: &Groups) -> Result<()> {
    if takes_hopper(device, a.lhs.dtype(), &a.shape) {
        return ragged_dot_hopper(stream, device, a, g, None);
    }
    ragged_dot_simt(stream, a, g)
}

/// The group arguments of a ragged_dot call that writes something (rows and
/// columns), else None.
fn writes_something(a: &RaggedDot) -> Result<Option<Groups>> {
    if a.shape.m == 0 || a.shape.n == 0 {
        return Ok(None);
    }
    Groups::of(&a.shape, a.group_sizes.device_ptr(), a.group_offset.device_ptr()).map(Some)
}

/// The hidden activation ragged_dot_activation writes after its product
/// (from the Hopper kernel's epilogue), at `hidden`.
struct Epilogue {
    activation: Activation,
    hidden: u64,
}

/// On Hopper, when the product takes the tensor cores and a gated
/// activation's halves start at 16-byte multiples (F a multiple of 8), the
/// activation in the product's epilogue; else the product, then
/// `activation_fwd` over its rows (all of them: without `zero_unused_rows`,
/// those outside the window get the activation of whatever they held, as
/// unspecified as that).
pub fn ragged_dot_activation(stream: Stream, a: &RaggedDotActivation) -> Result<()> {
    let product = &a.product;
    let Some(g) = writes_something(product)? else { return Ok(()) };
    let device = stream.device()?;
    let features = a.features();
    if takes_hopper(device, product.lhs.dtype(), &product.shape) && features.is_multiple_of(8) {
        let epilogue = Epilogue { activation: a.activation, hidden: a.hidden.device_ptr() };
        return ragged_dot_hopper(stream, device, product, &g, Some(epilogue));
    }
    plain_product(stream, device, product, &g)?;
    activation::cuda::activation_fwd(stream, product.lhs.dtype(), a.activation, product.shape.m, features,
                                     product.out.device_ptr(), a.hidden.device_ptr())
}

fn ragged_dot_hopper(stream: Stream, device: &Device, a: &RaggedDot, g: &Groups, epilogue: Option<Epilogue>)
                     -> Result<()> {
    let shape = &a.shape;
    let (dtype, out_dtype) = (a.lhs.dtype(), a.out.dtype());
    let [m, k, n] = g.dims;
    let (lhs, rhs, out) = (a.lhs.device_ptr(), a.rhs.device_ptr(), a.out.device_ptr());
    let bn = block_n(shape.n);
    let (k64, n64, m64, gl) = (shape.k as u64, shape.n as u64, shape.m as u64, shape.local_groups as u64);
    // A tile's columns: of the hidden activation with an epilogue (half the
    // product's, gated), and the columns they tile (the hidden activation's).
    let gated = epilogue.as_ref().is_some_and(|e| e.activation.gated());
    let columns = epilogue.as_ref().map_or(shape.n, |e| e.activation.hidden_columns(shape.n));
    let width = if gated { bn / 2 } else { bn };
    let cluster = hopper_cluster(device, columns, width);
    let lhs_map = TensorMap::tiled_16bit(lhs, &[k64, m64], &[BLOCK_K, a_box_rows(cluster)])?;
    let rhs_map = if a.rhs_transposed {
        TensorMap::tiled_16bit(rhs, &[k64, n64, gl], &[BLOCK_K, bn, 1])?
    } else {
        TensorMap::tiled_16bit(rhs, &[n64, k64, gl], &[64, BLOCK_K, 1])?
    };
    // Gated, the kernel stores the pre-activation's halves through a map of
    // [m, 2, F], which clips each at F.
    let out_map = if gated {
        TensorMap::tiled_16bit(out, &[n64 / 2, 2, m64], &[64, 1, 64])?
    } else {
        out_map(out_dtype, out, n64, m64)?
    };
    let (hidden, hidden_map) = match &epilogue {
        Some(e) => (e.hidden, TensorMap::tiled_16bit(e.hidden, &[columns as u64, m64], &[64, 64])?),
        None => (0, TensorMap::unused()),
    };
    let activation = epilogue.map(|e| e.activation);
    let instance = ragged_dot_hopper_instance(dtype, out_dtype, a.rhs_transposed, cluster, activation, bn)?;
    launch_hopper(stream, device, &instance, bn, cluster, &mut [
        arg(&lhs_map), arg(&rhs_map), arg(&g.sizes), arg(&g.groups), arg(&g.offset), arg(&g.local_groups),
        arg(&m), arg(&k), arg(&n), arg(&out), arg(&out_map), arg(&hidden), arg(&hidden_map), arg(&a.zero_unused_rows),
    ])
}

fn ragged_dot_simt(stream: Stream, a: &RaggedDot, g: &Groups) -> Result<()> {
    let shape = &a.shape;
    let (dtype, out_dtype) = (a.lhs.dtype(), a.out.dtype());
    let [m, k, n] = g.dims;
    let (lhs, rhs, out) = (a.lhs.device_ptr(), a.rhs.device_ptr(), a.out.device_ptr());
    let rows = chunk_bounds(stream, shape, g.sizes, g.offset, &[shape.m], a.workspace.device_ptr())?;
    let kernel = Kernel::get(stream, &GROUPED_GEMM, &ragged_dot_simt_instance(dtype, out_dtype, a.rhs_transposed)?)?;
    let blocks = shape.m.div_ceil(SIMT_TILE) * shape.n.div_ceil(SIMT_TILE);
    launch(stream, kernel, LaunchConfig { grid: grid(blocks)?, block: SIMT_THREADS, shared_bytes: 0 }, &mut [
        arg(&lhs), arg(&rhs), arg(&rows.bounds), arg(&g.local_groups), arg(&m), arg(&k), arg(&n), arg(&out),
        arg(&a.zero_unused_rows),
    ])
}

pub fn transposed_ragged_dot(stream: Stream, a: &TransposedRaggedDot) -> Result<()> {
    let shape = &a.shape;
    if shape.local_groups == 0 || shape.k == 0 || shape.n == 0 {
        return Ok(());
    }
    let (dtype, out_dtype) = (a.chunks[0].lhs.dtype(), a.out.dtype());
    let (k, n, chunks) = (int(shape.k)?, int(shape.n)?, int(a.chunks.len())?);
    let out = a.out.device_ptr();
    let rows: Vec<usize> = a.chunks.iter().map(|c| c.rows).collect();
    let bounds = chunk_bounds(stream, shape, a.group_sizes.device_ptr(), a.group_offset.device_ptr(), &rows, a.workspace.device_ptr())?;

    let device = stream.device()?;
    if shape.m > 0 && takes_hopper(device, dtype, shape) {
        let bn = block_n(shape.n);
        let (k64, n64) = (shape.k as u64, shape.n as u64);
        let mut maps = ChunkMaps { lhs: std::array::from_fn(|_| TensorMap::unused()), rhs: std::array::from_fn(|_| TensorMap::unused()) };
        // A chunk without rows is never loaded from (its bounds are empty), and has no map.
        for (c, chunk) in a.chunks.iter().enumerate().filter(|(_, chunk)| chunk.rows > 0) {
            let m64 = chunk.rows as u64;
            maps.lhs[c] = TensorMap::tiled_16bit(chunk.lhs.device_ptr(), &[k64, m64], &[64, 64])?;
            maps.rhs[c] = TensorMap::tiled_16bit(chunk.rhs.device_ptr(), &[n64, m64], &[64, 64])?;
        }
        let out_map = out_map(out_dtype, out, n64, transposed_out_rows(shape)?)?;
        let instance = transposed_hopper_instance(dtype, out_dtype, bn)?;
        launch_hopper(stream, device, &instance, bn, 1, &mut [
            arg(&maps), arg(&chunks), arg(&bounds), arg(&k), arg(&n), arg(&out), arg(&out_map),
        ])
    } else {
        let mut operands = ChunkOperands { lhs: [0; MAX_CHUNKS], rhs: [0; MAX_CHUNKS] };
        for (c, chunk) in a.chunks.iter().enumerate() {
            (operands.lhs[c], operands.rhs[c]) = (chunk.lhs.device_ptr(), chunk.rhs.device_ptr());
        }
        let kernel = Kernel::get(stream, &GROUPED_GEMM, &transposed_simt_instance(dtype, out_dtype)?)?;
        let blocks = shape.local_groups * shape.k.div_ceil(SIMT_TILE) * shape.n.div_ceil(SIMT_TILE);
        launch(stream, kernel, LaunchConfig { grid: grid(blocks)?, block: SIMT_THREADS, shared_bytes: 0 }, &mut [
            arg(&operands), arg(&chunks), arg(&bounds), arg(&k), arg(&n), arg(&out),
        ])
    }
}

/// The FP8 kernels' `Fp8ChunkOperands`: each chunk's values, scales and rows
/// (null and 0 past the chunks).
#[repr(C)]
struct Fp8ChunkOperands {
    lhs: [u64; MAX_CHUNKS],
    lhs_scales: [u64; MAX_CHUNKS],
    rhs: [u64; MAX_CHUNKS],
    rhs_scales: [u64; MAX_CHUNKS],
    rows: [i32; MAX_CHUNKS],
}

/// On Hopper, the FP8 product whose operands are both K-major (the
/// `rhs_transposed` form: 8-bit `wgmma` reads no other layout) runs on the
/// tensor cores; the other form, and every other GPU, on the SIMT kernels.
pub fn fp8_ragged_dot(stream: Stream, a: &Fp8RaggedDot) -> Result<()> {
    let shape = &a.shape;
    if shape.m == 0 || shape.n == 0 {
        return Ok(());
    }
    let g = Groups::of(shape, a.group_sizes.device_ptr(), a.group_offset.device_ptr())?;
    let [m, k, n] = g.dims;
    let device = stream.device()?;
    if a.rhs_transposed && on_hopper(device, shape) {
        let (k64, n64, m64, gl) = (shape.k as u64, shape.n as u64, shape.m as u64, shape.local_groups as u64);
        let cluster = hopper_cluster(device, shape.n, FP8_BLOCK);
        let lhs_map = TensorMap::tiled_8bit(a.lhs.device_ptr(), &[k64, m64], &[FP8_BLOCK, a_box_rows(cluster)])?;
        let rhs_map = TensorMap::tiled_8bit(a.rhs.device_ptr(), &[k64, n64, gl], &[FP8_BLOCK, FP8_BLOCK, 1])?;
        let (lhs_scales, rhs_scales, out) = (a.lhs_scales.device_ptr(), a.rhs_scales.device_ptr(), a.out.device_ptr());
        let out_map = out_map(a.out.dtype(), out, n64, m64)?;
        return launch_persistent(stream, device, &fp8_ragged_dot_hopper_instance(a.out.dtype(), cluster)?, fp8_hopper_shared_bytes(MAX_LOCAL_GROUPS, 0), cluster, &mut [
            arg(&lhs_map), arg(&lhs_scales), arg(&rhs_map), arg(&rhs_scales), arg(&g.sizes), arg(&g.groups), arg(&g.offset),
            arg(&g.local_groups), arg(&m), arg(&k), arg(&n), arg(&out), arg(&out_map),
        ]);
    }
    let rows = chunk_bounds(stream, shape, g.sizes, g.offset, &[shape.m], a.workspace.device_ptr())?;
    let kernel = Kernel::get(stream, &GROUPED_GEMM, &fp8_ragged_dot_simt_instance(a.out.dtype(), a.rhs_transposed)?)?;
    let blocks = shape.m.div_ceil(SIMT_TILE) * shape.n.div_ceil(SIMT_TILE);
    let (lhs, lhs_scales, rhs, rhs_scales, out) =
        (a.lhs.device_ptr(), a.lhs_scales.device_ptr(), a.rhs.device_ptr(), a.rhs_scales.device_ptr(), a.out.device_ptr());
    launch(stream, kernel, LaunchConfig { grid: grid(blocks)?, block: SIMT_THREADS, shared_bytes: 0 }, &mut [
        arg(&lhs), arg(&lhs_scales), arg(&rhs), arg(&rhs_scales), arg(&rows.bounds), arg(&g.local_groups), arg(&m),
        arg(&k), arg(&n), arg(&out),
    ])
}

/// The Hopper kernel's `Fp8ChunkMaps`: each chunk's K-major values (tensor maps) and scales.
#[repr(C)]
struct Fp8ChunkMaps {
    lhs: [TensorMap; MAX_CHUNKS],
    rhs: [TensorMap; MAX_CHUNKS],
    lhs_scales: [u64; MAX_CHUNKS],
    rhs_scales: [u64; MAX_CHUNKS],
}

/// On Hopper, the weight gradient runs on the tensor cores (its operands come
/// K-major, each column's tokens contiguous, as 8-bit `wgmma` reads them);
/// elsewhere on the SIMT kernel.
pub fn fp8_transposed_ragged_dot(stream: Stream, a: &Fp8TransposedRaggedDot) -> Result<()> {
    let shape = &a.shape;
    if shape.local_groups == 0 || shape.k == 0 || shape.n == 0 {
        return Ok(());
    }
    let (k, n, chunks) = (int(shape.k)?, int(shape.n)?, int(a.chunks.len())?);
    let rows: Vec<usize> = a.chunks.iter().map(|c| c.rows).collect();
    let bounds = chunk_bounds(stream, shape, a.group_sizes.device_ptr(), a.group_offset.device_ptr(), &rows, a.workspace.device_ptr())?;
    let device = stream.device()?;
    if shape.m > 0 && on_hopper(device, shape) {
        let cluster = hopper_cluster(device, shape.n, FP8_BLOCK);
        let mut maps = Fp8ChunkMaps {
            lhs: std::array::from_fn(|_| TensorMap::unused()),
            rhs: std::array::from_fn(|_| TensorMap::unused()),
            lhs_scales: [0; MAX_CHUNKS],
            rhs_scales: [0; MAX_CHUNKS],
        };
        for (c, chunk) in a.chunks.iter().enumerate() {
            (maps.lhs_scales[c], maps.rhs_scales[c]) = (chunk.lhs_scales.device_ptr(), chunk.rhs_scales.device_ptr());
            // A chunk without rows is never loaded from (its bounds are empty), and has no map.
            if chunk.rows == 0 {
                continue;
            }
            let m64 = chunk.rows as u64;
            maps.lhs[c] = TensorMap::tiled_8bit(chunk.lhs.device_ptr(), &[m64, shape.k as u64], &[FP8_BLOCK, a_box_rows(cluster)])?;
            maps.rhs[c] = TensorMap::tiled_8bit(chunk.rhs.device_ptr(), &[m64, shape.n as u64], &[FP8_BLOCK, FP8_BLOCK])?;
        }
        let out = a.out.device_ptr();
        let out_map = out_map(a.out.dtype(), out, shape.n as u64, transposed_out_rows(shape)?)?;
        let instance = fp8_transposed_hopper_instance(a.out.dtype(), a.rhs_block_columns, cluster)?;
        return launch_persistent(stream, device, &instance, fp8_hopper_shared_bytes(0, FP8_TRANSPOSED_SCALE_BYTES), cluster, &mut [
            arg(&maps), arg(&chunks), arg(&bounds), arg(&k), arg(&n), arg(&out), arg(&out_map),
        ]);
    }
    let mut operands = Fp8ChunkOperands {
        lhs: [0; MAX_CHUNKS], lhs_scales: [0; MAX_CHUNKS], rhs: [0; MAX_CHUNKS], rhs_scales: [0; MAX_CHUNKS],
        rows: [0; MAX_CHUNKS],
    };
    for (c, chunk) in a.chunks.iter().enumerate() {
        operands.lhs[c] = chunk.lhs.device_ptr();
        operands.lhs_scales[c] = chunk.lhs_scales.device_ptr();
        operands.rhs[c] = chunk.rhs.device_ptr();
        operands.rhs_scales[c] = chunk.rhs_scales.device_ptr();
        operands.rows[c] = int(chunk.rows)?;
    }
    let kernel = Kernel::get(stream, &GROUPED_GEMM, &fp8_transposed_simt_instance(a.out.dtype(), a.rhs_block_columns)?)?;
    let blocks = shape.local_groups * shape.k.div_ceil(SIMT_TILE) * shape.n.div_ceil(SIMT_TILE);
    let out = a.out.device_ptr();
    launch(stream, kernel, LaunchConfig { grid: grid(blocks)?, block: SIMT_THREADS, shared_bytes: 0 }, &mut [
        arg(&operands), arg(&chunks), arg(&bounds), arg(&k), arg(&n), arg(&out),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::{assert_compiles, compile_check, Architecture};

    fn types() -> [(DataType, DataType); 5] {
        let (bf16, f16, f32) = (DataType::BF16, DataType::F16, DataType::F32);
        [(bf16, bf16), (bf16, f32), (f16, f16), (f16, f32), (f32, f32)]
    }

    fn simt_instances() -> Vec<String> {
        let mut instances = vec!["group_bounds".to_string()];
        for (dtype, out) in types() {
            for transposed in [false, true] {
                instances.push(ragged_dot_simt_instance(dtype, out, transposed).unwrap());
            }
            instances.push(transposed_simt_instance(dtype, out).unwrap());
        }
        for out in [DataType::F32, DataType::BF16, DataType::F16] {
            for transposed in [false, true] {
                instances.push(fp8_ragged_dot_simt_instance(out, transposed).unwrap());
            }
            for rhs_block_columns in [1, FP8_BLOCK as usize] {
                instances.push(fp8_transposed_simt_instance(out, rhs_block_columns).unwrap());
            }
        }
        instances
    }

    fn hopper_instances() -> Vec<String> {
        let mut instances = Vec::new();
        for (dtype, out) in types().into_iter().filter(|(d, _)| *d != DataType::F32) {
            for bn in [128, 256] {
                for transposed in [false, true] {
                    for cluster in [1, 2] {
                        instances.push(ragged_dot_hopper_instance(dtype, out, transposed, cluster, None, bn).unwrap());
                    }
                }
                instances.push(transposed_hopper_instance(dtype, out, bn).unwrap());
            }
        }
        // ragged_dot_activation's: outputs in the inputs' 16-bit type, rhs [G, K, N].
        for dtype in [DataType::BF16, DataType::F16] {
            for activation in Activation::ALL {
                for (bn, cluster) in [(128, 1), (256, 2)] {
                    instances.push(ragged_dot_hopper_instance(dtype, dtype, false, cluster, Some(activation), bn).unwrap());
                }
            }
        }
        for out in [DataType::BF16, DataType::F16, DataType::F32] {
            for cluster in [1, 2] {
                instances.push(fp8_ragged_dot_hopper_instance(out, cluster).unwrap());
                for rhs_block_columns in [1, FP8_BLOCK as usize] {
                    instances.push(fp8_transposed_hopper_instance(out, rhs_block_columns, cluster).unwrap());
                }
            }
        }
        instances
    }

    /// CI has no GPU but has NVRTC: every instance a call can ask for compiles
    /// for the architectures it runs on (the Hopper kernels only for sm_90a).
    #[test]
    fn grouped_gemm_kernels_compile_for_ampere_hopper_and_blackwell() {
        let (simt, mut all) = (simt_instances(), simt_instances());
        all.extend(hopper_instances());
        assert_compiles(&GROUPED_GEMM, &[("sm_80", &simt), ("sm_90a", &all), ("sm_100", &simt)]);
    }

    /// The kernel checks the launch's shared memory against its own layout:
    /// eight bytes short, the instance does not compile.
    #[test]
    fn a_hopper_launch_that_disagrees_with_the_kernels_layout_does_not_compile() {
        let instance = Instance::new("ragged_dot_hopper").dtype(DataType::BF16).dtype(DataType::BF16).flag(false).int(1).int(0);
        let short = instance.int(256).int(hopper_stages(256)).int(MAX_LOCAL_GROUPS).int(HOPPER_THREADS).int(hopper_shared_bytes(256) - 8);
        let error = compile_check(&GROUPED_GEMM, &[&short.build().unwrap()], &Architecture("sm_90a".into())).unwrap_err();
        assert!(error.message().contains("the launch's dynamic shared memory is this layout's"), "{}", error.message());
    }

    /// Both configurations fit the 227 KiB a Hopper block may have.
    #[test]
    fn hopper_shared_memory_fits() {
        for bn in [128, 256] {
            assert!(hopper_shared_bytes(bn) <= 227 * 1024, "{bn}: {}", hopper_shared_bytes(bn));
        }
        for bytes in [fp8_hopper_shared_bytes(MAX_LOCAL_GROUPS, 0), fp8_hopper_shared_bytes(0, FP8_TRANSPOSED_SCALE_BYTES)] {
            assert!(bytes <= 227 * 1024, "FP8: {bytes}");
        }
    }

    #[test]
    fn wide_tiles_unless_the_last_is_mostly_empty() {
        assert_eq!(block_n(4096), 256);
        assert_eq!(block_n(768), 256);
        assert_eq!(block_n(7168), 256);
        assert_eq!(block_n(2048), 256);
        assert_eq!(block_n(1024), 256);
        assert_eq!(block_n(384), 128);
        assert_eq!(block_n(64), 128);
    }
}
