//! Every kernel name the launchers ask for, built here and nowhere else, and [`all`]: each
//! (module, name) that the instantiation lists of kernels/*.cu must provide for the calls that
//! validation admits. Unit tests (below) check the table against the kernels each file defines
//! (read by build.rs), both ways; the suite's `kernel_names` test resolves each on a GPU. So a
//! launcher and an instantiation list cannot drift apart without a test failing.

use crate::DType;
use DType::{BF16, F16, F32};

/// The modules: kernels/*.cu file stems.
pub const SCAN_FWD: &str = "selective_scan_fwd";
pub const SCAN_BWD: &str = "selective_scan_bwd";
/// The scans' packed-sequence kernels: files of their own, so that nvcc compiles each scan's two
/// halves in parallel.
pub const SCAN_FWD_PACKED: &str = "selective_scan_fwd_packed";
pub const SCAN_BWD_PACKED: &str = "selective_scan_bwd_packed";
pub const SCAN_CARRY: &str = "selective_scan_carry";
pub const STATE_UPDATE: &str = "selective_state_update";
pub const CONV: &str = "causal_conv1d";
pub const SSD_GLUE: &str = "ssd_glue";
pub const SSD_FWD: &str = "ssd_fwd";
pub const SSD_BWD: &str = "ssd_bwd";

fn join(types: &[DType]) -> String {
    types.iter().map(|t| t.name()).collect::<Vec<_>>().join("_")
}

/// The selective scan's (u, B/C) dtypes: B/C f32 or u's dtype.
const SCAN_TYPES: [(DType, DType); 5] = [(F32, F32), (BF16, BF16), (BF16, F32), (F16, F16), (F16, F32)];
/// The forward's B/C forms (`BcForm`).
pub const SCAN_FWD_FORMS: [&str; 3] = ["varying", "varying_vec", "invariant"];
/// Threads per channel of the tiled kernels (1: the forward's output pass only, unpacked).
const SCAN_TPC: [i64; 6] = [1, 2, 4, 8, 16, 32];

/// The module of a forward scan kernel.
pub fn scan_fwd_module(packed: bool) -> &'static str {
    if packed {
        SCAN_FWD_PACKED
    } else {
        SCAN_FWD
    }
}

/// The module of a backward scan kernel (the reductions: [`SCAN_BWD`]).
pub fn scan_bwd_module(packed: bool) -> &'static str {
    if packed {
        SCAN_BWD_PACKED
    } else {
        SCAN_BWD
    }
}

/// The forward's tiled kernel: the split's first pass (`local`) or the output pass.
pub fn scan_fwd_tiled(local: bool, packed: bool, types: (DType, DType), tpc: i64, form: &str) -> String {
    let pass = if local { "tiled_local" } else { "tiled" };
    let packed = if packed { "_packed" } else { "" };
    format!("selective_scan_fwd_{pass}{packed}_{}_tpc{tpc}_{form}", join(&[types.0, types.1]))
}

/// The forward's lanes kernel, `lanes` lanes a channel.
pub fn scan_fwd_lanes(packed: bool, types: (DType, DType), lanes: i64) -> String {
    let packed = if packed { "_packed" } else { "" };
    format!("selective_scan_fwd_lanes{packed}_{}_ns{lanes}", join(&[types.0, types.1]))
}

/// The backward's tiled kernel (B/C time-varying or not).
pub fn scan_bwd_tiled(local: bool, packed: bool, types: (DType, DType), tpc: i64, varying: bool) -> String {
    let pass = if local { "tiled_local" } else { "tiled" };
    let packed = if packed { "_packed" } else { "" };
    let form = if varying { "varying" } else { "invariant" };
    format!("selective_scan_bwd_{pass}{packed}_{}_tpc{tpc}_{form}", join(&[types.0, types.1]))
}

/// The backward's reductions: of the time-varying dB/dC partials (`bc`), or of the parameters'.
pub fn scan_bwd_reduce(bc: bool, bc_dtype: DType) -> String {
    format!("selective_scan_bwd_reduce_{}_{}", if bc { "bc" } else { "params" }, bc_dtype.name())
}

/// The carried state of a seqlen shard: added to its outputs (`fwd`) or its gradient (`bwd`).
pub fn scan_carry(fwd: bool, types: (DType, DType)) -> String {
    format!("selective_scan_carry_{}_{}", if fwd { "fwd" } else { "bwd" }, join(&[types.0, types.1]))
}

/// The chunk records where the forward's tiled first pass does not apply.
pub fn scan_chunk_records(types: (DType, DType)) -> String {
    format!("selective_scan_chunk_records_{}", join(&[types.0, types.1]))
}

/// The state update (x, B/C, state dtypes), the fast form or the general one.
pub fn state_update(types: [DType; 3], fast: bool) -> String {
    format!("selective_state_update_{}{}", join(&types), if fast { "_fast" } else { "" })
}

/// The fused decode step (x, B/C, state, conv weight dtypes).
pub fn decode_step(types: [DType; 4], fast: bool) -> String {
    format!("mamba_decode_step_{}{}", join(&types), if fast { "_fast" } else { "" })
}

/// The conv1d kernels.
#[derive(Clone, Copy)]
pub enum Conv {
    Fwd,
    BwdDx,
    BwdDw,
    /// The decode-time update (no packed form).
    Update,
}

pub fn conv(kernel: Conv, packed: bool, types: (DType, DType)) -> String {
    let name = match kernel {
        Conv::Fwd => "fwd",
        Conv::BwdDx => "bwd_dx",
        Conv::BwdDw => "bwd_dw",
        Conv::Update => "update",
    };
    let packed = if packed { "packed_" } else { "" };
    format!("causal_conv1d_{name}_{packed}{}", join(&[types.0, types.1]))
}

/// SSD's glue kernels that take no dtype.
pub const SSD_GLUE_EXPAND_PARAMS: &str = "ssd_glue_expand_params";
pub const SSD_GLUE_REDUCE_HEADS: &str = "ssd_glue_reduce_heads";
/// SSD's glue kernels per dtype: `expand_delta`, `reduce_ddt` and `gather` (any dtype),
/// `widen_chunk_states`, `split_heads_expand` and `split_heads_fold` (bf16 and f16).
pub fn ssd_glue(kernel: &str, dtype: DType) -> String {
    format!("ssd_glue_{kernel}_{}", dtype.name())
}

/// The tensor-core kernels' dtypes and dstates.
const SSD_MMA_TYPES: [DType; 2] = [BF16, F16];
const SSD_MMA_DSTATES: [i64; 2] = [64, 128];

/// The tensor-core forward: the split's first pass (`local`), or the pass that writes y (`gated`:
/// with z); `packed`: the kernels that cut their tiles at packed sequences' boundaries.
pub fn ssd_fwd_mma(local: bool, gated: bool, packed: bool, dtype: DType, dstate: i64) -> String {
    let kind = if local {
        "_local"
    } else if gated {
        "_gated"
    } else {
        ""
    };
    let packed = if packed { "_packed" } else { "" };
    format!("ssd_fwd_mma{kind}{packed}_{}_n{dstate}", dtype.name())
}

/// The tensor-core backward's kernels per dtype and dstate: `mma`, `mma_partials`, `mma_local`,
/// `bc_sums`.
pub fn ssd_bwd_mma(kernel: &str, dtype: DType, dstate: i64) -> String {
    format!("ssd_bwd_{kernel}_{}_n{dstate}", dtype.name())
}

/// The tensor-core backward's kernels per dtype: `chunk_scalars`, `head_msum`, `gate_grad`,
/// `reduce_bc`.
pub fn ssd_bwd_per_type(kernel: &str, dtype: DType) -> String {
    format!("ssd_bwd_{kernel}_{}", dtype.name())
}
pub const SSD_BWD_REDUCE_PARAMS: &str = "ssd_bwd_reduce_params";
/// `ssd_part_records`' fold of its records into the end states.
pub const SSD_FOLD_PART_RECORDS: &str = "ssd_fold_part_records";
/// The wgmma forward's tile scalars, formed ahead of it into y's rows, per dtype.
pub fn ssd_fwd_tile_scalars(dtype: DType) -> String {
    format!("ssd_fwd_tile_scalars_{}", dtype.name())
}

/// Every (module, kernel) a launcher can ask for.
pub fn all() -> Vec<(&'static str, String)> {
    let mut names = Vec::new();
    for types in SCAN_TYPES {
        for tpc in SCAN_TPC {
            for form in SCAN_FWD_FORMS {
                // The split's first pass (`local`) has no form at one thread a channel.
                for packed in [false, true] {
                    names.push((scan_fwd_module(packed), scan_fwd_tiled(false, packed, types, tpc, form)));
                    if tpc > 1 {
                        names.push((scan_fwd_module(packed), scan_fwd_tiled(true, packed, types, tpc, form)));
                    }
                }
            }
            if tpc > 1 {
                for local in [false, true] {
                    for packed in [false, true] {
                        for varying in [false, true] {
                            names.push((scan_bwd_module(packed), scan_bwd_tiled(local, packed, types, tpc, varying)));
                        }
                    }
                }
            }
        }
        for lanes in [1, 2, 4, 8, 16, 32] {
            for packed in [false, true] {
                names.push((scan_fwd_module(packed), scan_fwd_lanes(packed, types, lanes)));
            }
        }
        for fwd in [true, false] {
            names.push((SCAN_CARRY, scan_carry(fwd, types)));
        }
        names.push((SCAN_CARRY, scan_chunk_records(types)));
        for packed in [false, true] {
            for kernel in [Conv::Fwd, Conv::BwdDx, Conv::BwdDw] {
                names.push((CONV, conv(kernel, packed, types)));
            }
        }
        names.push((CONV, conv(Conv::Update, false, types)));
    }
    for dtype in [F32, BF16, F16] {
        names.push((SCAN_BWD, scan_bwd_reduce(true, dtype)));
        names.push((SCAN_BWD, scan_bwd_reduce(false, dtype)));
        names.push((SSD_GLUE, ssd_glue("expand_delta", dtype)));
        names.push((SSD_GLUE, ssd_glue("reduce_ddt", dtype)));
        names.push((SSD_GLUE, ssd_glue("gather", dtype)));
        // (x, B/C, state[, conv weight]): each but x f32 or x's dtype.
        let other = if dtype == F32 { vec![F32] } else { vec![dtype, F32] };
        for &w in &other {
            for &s in &other {
                for fast in [false, true] {
                    names.push((STATE_UPDATE, state_update([dtype, w, s], fast)));
                    for &wt in &other {
                        names.push((STATE_UPDATE, decode_step([dtype, w, s, wt], fast)));
                    }
                }
            }
        }
    }
    names.push((SSD_GLUE, SSD_GLUE_EXPAND_PARAMS.to_string()));
    names.push((SSD_GLUE, SSD_GLUE_REDUCE_HEADS.to_string()));
    names.push((SSD_BWD, SSD_BWD_REDUCE_PARAMS.to_string()));
    names.push((SSD_FWD, SSD_FOLD_PART_RECORDS.to_string()));
    for dtype in SSD_MMA_TYPES {
        names.push((SSD_FWD, ssd_fwd_tile_scalars(dtype)));
        names.push((SSD_GLUE, ssd_glue("widen_chunk_states", dtype)));
        names.push((SSD_GLUE, ssd_glue("split_heads_expand", dtype)));
        names.push((SSD_GLUE, ssd_glue("split_heads_fold", dtype)));
        for kernel in ["chunk_scalars", "head_msum", "gate_grad", "reduce_bc"] {
            names.push((SSD_BWD, ssd_bwd_per_type(kernel, dtype)));
        }
        for dstate in SSD_MMA_DSTATES {
            for (local, gated) in [(false, false), (false, true), (true, false)] {
                for packed in [false, true] {
                    names.push((SSD_FWD, ssd_fwd_mma(local, gated, packed, dtype, dstate)));
                }
            }
            for kernel in ["mma", "mma_partials", "mma_local", "bc_sums"] {
                names.push((SSD_BWD, ssd_bwd_mma(kernel, dtype, dstate)));
            }
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defined(module: &str) -> &'static [&'static str] {
        let found = super::super::KERNEL_NAMES.iter().find(|(m, _)| *m == module);
        found.unwrap_or_else(|| panic!("no embedded module {module}")).1
    }

    /// Each name a launcher can ask for is a kernel its module's file defines (the names build.rs
    /// read from the preprocessed kernels/*.cu, which the fatbins are compiled from).
    #[test]
    fn every_kernel_name_is_defined_by_its_file() {
        let names = all();
        let missing: Vec<String> = names
            .iter()
            .filter(|(module, name)| !defined(module).contains(&name.as_str()))
            .map(|(module, name)| format!("{module}: {name}"))
            .collect();
        assert!(
            missing.is_empty(),
            "{} of {} kernel names not defined:\n{}",
            missing.len(),
            names.len(),
            missing.join("\n")
        );
    }

    /// ...and each kernel a file defines is one a launcher can ask for (no dead instantiations).
    #[test]
    fn every_defined_kernel_is_in_the_table() {
        let names = all();
        let mut unused = Vec::new();
        for (module, _) in super::super::FATBINS {
            for kernel in defined(module) {
                if !names.iter().any(|(m, n)| m == module && n == kernel) {
                    unused.push(format!("{module}: {kernel}"));
                }
            }
        }
        assert!(unused.is_empty(), "{} kernels no launcher asks for:\n{}", unused.len(), unused.join("\n"));
    }

    /// The names build.rs found: every module has some, and one the files do not define is absent.
    #[test]
    fn the_defined_names_were_read() {
        for (module, _) in super::super::FATBINS {
            assert!(!defined(module).is_empty(), "no kernels read from kernels/{module}.cu");
        }
        let local_one_thread = scan_fwd_tiled(true, true, (F32, F32), 1, "varying");
        assert!(!defined(SCAN_FWD_PACKED).contains(&local_one_thread.as_str()));
        assert!(defined(SCAN_FWD_PACKED).contains(&scan_fwd_tiled(false, true, (F32, F32), 1, "varying").as_str()));
    }
}
