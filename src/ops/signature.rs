//! What every XLA target takes and returns, by name: the one table the XLA adapter decodes call
//! frames by (src/xla/operands.rs), the C API's argument structs are named after, and the Python
//! package is checked against (`xla_ssm_target_signatures`, tests/python/test_signatures.py).

/// When an operand or a result is part of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    Always,
    /// When this bool attribute is true (`has_d`, `save_chunk_states`, ...); an optional one that
    /// the call leaves out is false.
    Flag(&'static str),
    /// When this integer attribute is nonzero (`checkpoint_len`).
    NonZero(&'static str),
}

/// An operand or a result.
#[derive(Debug, Clone, Copy)]
pub struct Arg {
    pub name: &'static str,
    pub when: When,
}

/// The type of an attribute's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttrType {
    Bool,
    I64,
    F32,
    Str,
}

impl AttrType {
    pub fn name(self) -> &'static str {
        match self {
            AttrType::Bool => "bool",
            AttrType::I64 => "i64",
            AttrType::F32 => "f32",
            AttrType::Str => "str",
        }
    }
}

/// An attribute; an optional one may be left out (it then means what the op's docs say).
#[derive(Debug, Clone, Copy)]
pub struct Attr {
    pub name: &'static str,
    pub ty: AttrType,
    pub optional: bool,
}

/// One target: `xla_ssm_<op>`.
#[derive(Debug)]
pub struct Signature {
    pub op: &'static str,
    /// In call order: those whose [`When`] holds, in this order.
    pub operands: &'static [Arg],
    /// Likewise.
    pub results: &'static [Arg],
    /// Whether one more result may follow them: scratch for the CUDA kernels (`workspace`).
    pub workspace: bool,
    /// Every attribute the target reads, the flags of [`When`] included. A call may pass no other.
    pub attrs: &'static [Attr],
}

const fn arg(name: &'static str) -> Arg {
    Arg { name, when: When::Always }
}
const fn opt(name: &'static str, flag: &'static str) -> Arg {
    Arg { name, when: When::Flag(flag) }
}
const fn attr(name: &'static str, ty: AttrType) -> Attr {
    Attr { name, ty, optional: false }
}
const fn flag(name: &'static str) -> Attr {
    attr(name, AttrType::Bool)
}

use AttrType::{Bool, Str, F32, I64};

pub const SELECTIVE_SCAN_FWD: Signature = Signature {
    op: "selective_scan_fwd",
    operands: &[
        arg("u"),
        arg("delta"),
        arg("A"),
        arg("B"),
        arg("C"),
        opt("D", "has_d"),
        opt("z", "has_z"),
        opt("delta_bias", "has_delta_bias"),
        opt("initial_state", "has_initial_state"),
        opt("cu_seqlens", "has_cu_seqlens"),
        opt("chunk_records", "has_chunk_records"),
    ],
    results: &[arg("out"), arg("final_state"), Arg { name: "checkpoints", when: When::NonZero("checkpoint_len") }],
    workspace: true,
    attrs: &[
        attr("layout", Str),
        flag("delta_softplus"),
        flag("has_d"),
        flag("has_z"),
        flag("has_delta_bias"),
        flag("has_initial_state"),
        Attr { name: "has_cu_seqlens", ty: Bool, optional: true },
        Attr { name: "checkpoint_len", ty: I64, optional: true },
        Attr { name: "has_chunk_records", ty: Bool, optional: true },
    ],
};

/// The forward's sequence split, first pass only (docs/selective_scan_fwd.md, "Chunk records"):
/// each chunk's end state from zero and its sum of dt, for a later forward's `chunk_records`.
pub const SELECTIVE_SCAN_CHUNK_RECORDS: Signature = Signature {
    op: "selective_scan_chunk_records",
    operands: &[arg("u"), arg("delta"), arg("A"), arg("B"), opt("delta_bias", "has_delta_bias")],
    results: &[arg("chunk_records")],
    workspace: false,
    attrs: &[attr("layout", Str), flag("delta_softplus"), flag("has_delta_bias")],
};

pub const SELECTIVE_SCAN_BWD: Signature = Signature {
    op: "selective_scan_bwd",
    operands: &[
        arg("u"),
        arg("delta"),
        arg("A"),
        arg("B"),
        arg("C"),
        opt("D", "has_d"),
        opt("z", "has_z"),
        opt("delta_bias", "has_delta_bias"),
        opt("initial_state", "has_initial_state"),
        opt("cu_seqlens", "has_cu_seqlens"),
        arg("checkpoints"),
        arg("dout"),
        opt("dfinal_state", "has_dfinal_state"),
    ],
    results: &[
        arg("du"),
        arg("ddelta"),
        arg("dA"),
        arg("dB"),
        arg("dC"),
        opt("dD", "has_d"),
        opt("dz", "has_z"),
        opt("ddelta_bias", "has_delta_bias"),
        opt("dinitial_state", "has_initial_state"),
    ],
    workspace: true,
    attrs: &[
        attr("layout", Str),
        flag("delta_softplus"),
        flag("has_d"),
        flag("has_z"),
        flag("has_delta_bias"),
        flag("has_initial_state"),
        flag("has_dfinal_state"),
        Attr { name: "has_cu_seqlens", ty: Bool, optional: true },
        attr("checkpoint_len", I64),
    ],
};

/// The attributes both carry calls read.
const CARRY_ATTRS: [Attr; 5] =
    [attr("layout", Str), flag("delta_softplus"), flag("has_z"), flag("has_delta_bias"), attr("segment_len", I64)];

/// A seqlen shard's carried state (docs/selective_scan_carry.md): added to the outputs the shard's
/// scan made from a zero state, in place (`out` is aliased to `out`).
pub const SELECTIVE_SCAN_CARRY_FWD: Signature = Signature {
    op: "selective_scan_carry_fwd",
    operands: &[
        arg("out"),
        arg("delta"),
        arg("A"),
        arg("C"),
        opt("z", "has_z"),
        opt("delta_bias", "has_delta_bias"),
        arg("state"),
        arg("dt_sums"),
    ],
    results: &[arg("out")],
    workspace: false,
    attrs: &CARRY_ATTRS,
};

/// Its transpose: how the outputs' gradient reaches the state entering the shard, per segment.
pub const SELECTIVE_SCAN_CARRY_BWD: Signature = Signature {
    op: "selective_scan_carry_bwd",
    operands: &[
        arg("dout"),
        arg("delta"),
        arg("A"),
        arg("C"),
        opt("z", "has_z"),
        opt("delta_bias", "has_delta_bias"),
        arg("dt_sums"),
    ],
    results: &[arg("dstate_parts")],
    workspace: false,
    attrs: &CARRY_ATTRS,
};

/// The attributes both SSD calls read.
const SSD_ATTRS: [Attr; 8] = [
    attr("chunk_size", I64),
    flag("dt_softplus"),
    attr("dt_min", F32),
    attr("dt_max", F32),
    flag("has_d"),
    flag("has_z"),
    flag("has_dt_bias"),
    flag("has_initial_states"),
];

pub const SSD_FWD: Signature = Signature {
    op: "ssd_fwd",
    operands: &[
        arg("x"),
        arg("dt"),
        arg("A"),
        arg("B"),
        arg("C"),
        opt("D", "has_d"),
        opt("z", "has_z"),
        opt("dt_bias", "has_dt_bias"),
        opt("initial_states", "has_initial_states"),
        opt("cu_seqlens", "has_cu_seqlens"),
        opt("part_records", "has_part_records"),
    ],
    results: &[arg("y"), arg("final_states"), opt("chunk_states", "save_chunk_states")],
    workspace: true,
    attrs: &[
        SSD_ATTRS[0],
        SSD_ATTRS[1],
        SSD_ATTRS[2],
        SSD_ATTRS[3],
        SSD_ATTRS[4],
        SSD_ATTRS[5],
        SSD_ATTRS[6],
        SSD_ATTRS[7],
        flag("save_chunk_states"),
        Attr { name: "has_cu_seqlens", ty: Bool, optional: true },
        Attr { name: "has_part_records", ty: Bool, optional: true },
    ],
};

/// The tensor-core forward's first pass alone (docs/ssd.md, "Part records"): the end states from
/// zero, and the records a later forward's `part_records` takes.
pub const SSD_PART_RECORDS: Signature = Signature {
    op: "ssd_part_records",
    operands: &[arg("x"), arg("dt"), arg("A"), arg("B"), opt("dt_bias", "has_dt_bias")],
    results: &[arg("final_states"), arg("part_records")],
    workspace: false,
    attrs: &[SSD_ATTRS[0], SSD_ATTRS[1], SSD_ATTRS[2], SSD_ATTRS[3], SSD_ATTRS[6]],
};

pub const SSD_BWD: Signature = Signature {
    op: "ssd_bwd",
    operands: &[
        arg("x"),
        arg("dt"),
        arg("A"),
        arg("B"),
        arg("C"),
        opt("D", "has_d"),
        opt("z", "has_z"),
        opt("dt_bias", "has_dt_bias"),
        opt("initial_states", "has_initial_states"),
        opt("cu_seqlens", "has_cu_seqlens"),
        arg("chunk_states"),
        arg("dy"),
        opt("dfinal_states", "has_dfinal_states"),
    ],
    results: &[
        arg("dx"),
        arg("ddt"),
        arg("dA"),
        arg("dB"),
        arg("dC"),
        opt("dD", "has_d"),
        opt("dz", "has_z"),
        opt("ddt_bias", "has_dt_bias"),
        opt("dinitial_states", "has_initial_states"),
    ],
    workspace: true,
    attrs: &[
        SSD_ATTRS[0],
        SSD_ATTRS[1],
        SSD_ATTRS[2],
        SSD_ATTRS[3],
        SSD_ATTRS[4],
        SSD_ATTRS[5],
        SSD_ATTRS[6],
        SSD_ATTRS[7],
        flag("has_dfinal_states"),
        Attr { name: "has_cu_seqlens", ty: Bool, optional: true },
    ],
};

pub const SELECTIVE_STATE_UPDATE: Signature = Signature {
    op: "selective_state_update",
    operands: &[
        arg("state"),
        arg("x"),
        arg("dt"),
        arg("A"),
        arg("B"),
        arg("C"),
        opt("D", "has_d"),
        opt("z", "has_z"),
        opt("dt_bias", "has_dt_bias"),
        opt("state_batch_indices", "has_state_batch_indices"),
    ],
    results: &[arg("out"), arg("state")],
    workspace: false,
    attrs: &[flag("dt_softplus"), flag("has_d"), flag("has_z"), flag("has_dt_bias"), flag("has_state_batch_indices")],
};

pub const CAUSAL_CONV1D_FWD: Signature = Signature {
    op: "causal_conv1d_fwd",
    operands: &[
        arg("x"),
        arg("weight"),
        opt("bias", "has_bias"),
        opt("initial_states", "has_initial_states"),
        opt("cu_seqlens", "has_cu_seqlens"),
    ],
    results: &[arg("out")],
    workspace: false,
    attrs: &[
        flag("silu"),
        attr("layout", Str),
        flag("has_bias"),
        flag("has_initial_states"),
        Attr { name: "has_cu_seqlens", ty: Bool, optional: true },
    ],
};

pub const CAUSAL_CONV1D_BWD: Signature = Signature {
    op: "causal_conv1d_bwd",
    operands: &[
        arg("x"),
        arg("weight"),
        arg("dout"),
        opt("bias", "has_bias"),
        opt("initial_states", "has_initial_states"),
        opt("cu_seqlens", "has_cu_seqlens"),
    ],
    results: &[arg("dx"), arg("dweight"), opt("dbias", "has_bias"), opt("dinitial_states", "has_initial_states")],
    workspace: false,
    attrs: &[
        flag("silu"),
        attr("layout", Str),
        flag("has_bias"),
        flag("has_initial_states"),
        Attr { name: "has_cu_seqlens", ty: Bool, optional: true },
    ],
};

pub const CAUSAL_CONV1D_UPDATE: Signature = Signature {
    op: "causal_conv1d_update",
    operands: &[
        arg("x"),
        arg("conv_state"),
        arg("weight"),
        opt("bias", "has_bias"),
        opt("state_batch_indices", "has_state_batch_indices"),
    ],
    results: &[arg("out"), arg("conv_state")],
    workspace: false,
    attrs: &[flag("silu"), attr("layout", Str), flag("has_bias"), flag("has_state_batch_indices")],
};

pub const MAMBA_DECODE_STEP: Signature = Signature {
    op: "mamba_decode_step",
    operands: &[
        arg("x"),
        arg("conv_state"),
        arg("conv_weight"),
        arg("ssm_state"),
        arg("dt"),
        arg("A"),
        arg("B"),
        arg("C"),
        opt("conv_bias", "has_conv_bias"),
        opt("D", "has_d"),
        opt("z", "has_z"),
        opt("dt_bias", "has_dt_bias"),
        opt("state_batch_indices", "has_state_batch_indices"),
    ],
    results: &[arg("out"), arg("conv_state"), arg("ssm_state")],
    workspace: false,
    attrs: &[
        flag("dt_softplus"),
        flag("has_conv_bias"),
        flag("has_d"),
        flag("has_z"),
        flag("has_dt_bias"),
        flag("has_state_batch_indices"),
    ],
};

/// Every target, in the order `xla_ssm_target_signatures` lists them.
pub const ALL: [&Signature; 13] = [
    &SELECTIVE_SCAN_FWD,
    &SELECTIVE_SCAN_BWD,
    &SELECTIVE_SCAN_CHUNK_RECORDS,
    &SELECTIVE_SCAN_CARRY_FWD,
    &SELECTIVE_SCAN_CARRY_BWD,
    &SELECTIVE_STATE_UPDATE,
    &CAUSAL_CONV1D_FWD,
    &CAUSAL_CONV1D_BWD,
    &CAUSAL_CONV1D_UPDATE,
    &MAMBA_DECODE_STEP,
    &SSD_FWD,
    &SSD_BWD,
    &SSD_PART_RECORDS,
];

/// The table as JSON: `[{"op": ..., "operands": [{"name": ..., "when": ...}], "results": [...],
/// "workspace": bool, "attrs": [{"name": ..., "type": ..., "optional": ...}]}]`, where `when` is "always", `"flag:<attr>"`
/// or `"nonzero:<attr>"`.
pub fn to_json() -> String {
    let args = |list: &[Arg]| {
        let items: Vec<String> = list
            .iter()
            .map(|a| {
                let when = match a.when {
                    When::Always => "always".to_string(),
                    When::Flag(f) => format!("flag:{f}"),
                    When::NonZero(f) => format!("nonzero:{f}"),
                };
                format!("{{\"name\": \"{}\", \"when\": \"{when}\"}}", a.name)
            })
            .collect();
        format!("[{}]", items.join(", "))
    };
    let sigs: Vec<String> = ALL
        .iter()
        .map(|s| {
            let attrs: Vec<String> = s
                .attrs
                .iter()
                .map(|a| {
                    format!("{{\"name\": \"{}\", \"type\": \"{}\", \"optional\": {}}}", a.name, a.ty.name(), a.optional)
                })
                .collect();
            format!(
                "{{\"op\": \"{}\", \"operands\": {}, \"results\": {}, \"workspace\": {}, \"attrs\": [{}]}}",
                s.op,
                args(s.operands),
                args(s.results),
                s.workspace,
                attrs.join(", ")
            )
        })
        .collect();
    format!("[{}]", sigs.join(", "))
}
