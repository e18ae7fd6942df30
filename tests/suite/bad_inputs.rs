//! Generated bad inputs for every exported entry point: nothing a caller passes may crash the host.
//!
//! A fixed-seed generator (the splitmix [`Rng`] of tests/suite/common) mutates valid calls and checks what
//! each mutated call does. The valid calls are the ones the Elixir binding emits
//! (bindings/elixir/test/fixtures/exla_calls.txt, read as tests/suite/exla_frames.rs reads it), and
//! those of the targets it does not call (tests/suite/fixtures/carry_calls.txt): at least one per XLA target, and from them the C API's argument structs. Three tests:
//!
//! - `xla_handlers_refuse_bad_frames`: the `_cpu` and `_cuda` handler of every target (TARGETS) on
//!   call frames built by the fake runtime (tests/suite/common/xla.rs), mutated: frame, API table and
//!   struct sizes, stages, counts and arrays, each buffer's struct, rank, dims, dtype and data pointer
//!   (null, misaligned, overlapping another buffer, the in-place states aliased exactly or partly),
//!   operand and result counts, each attribute (missing, renamed, extra, of another type or width,
//!   null entries, bad values), and the values of packed sequences' boundaries (`cu_seqlens`);
//! - `c_api_refuses_bad_arguments`: every `xla_ssm_*_host` and `*_cuda_launch` with its argument
//!   struct mutated field by field (sizes, dtype and layout codes, flags, dt limits, each pointer null,
//!   misaligned, overlapping or shared, the boundaries' values), and NULL;
//! - `sizers_and_registration_refuse_bad_arguments`: the workspace sizers,
//!   `xla_ssm_ssd_chunk_states_dtype` and `xla_ssm_register_xla_targets`.
//!
//! Every case must come back as its mutation says: INVALID_ARGUMENT (the XLA error code or the C
//! status) with a message naming the problem (each mutation says which words: the operand, field or
//! attribute, or what is wrong: "null", "align", "overlap", "rank", ...), success where the mutation
//! keeps the call valid (an extra attribute, a flipped softplus, an in-place state aliased exactly,
//! two operands sharing a buffer), or either where an unusual call may be taken (smaller or zero
//! sizes); a CUDA entry point on a machine without a device must refuse a call it would run with an
//! error about CUDA, also where only values it cannot read are wrong (bad boundaries, which the
//! host entry points refuse). INTERNAL, or any message saying the library panicked, fails the test: it means
//! a check is missing. And no case may write outside its results: every buffer lies in one arena
//! between canary gaps, and after each call every byte outside the results the call describes (every
//! byte, when the call failed) must be as it was.
//!
//! `XLA_SSM_BAD_INPUT_CASES=<n>` (default 10000) is the number of cases of the three tests together,
//! `XLA_SSM_BAD_INPUT_SEED=<u64>` the seed; `XLA_SSM_BAD_INPUT_ONLY=<i>` runs case i alone and
//! `XLA_SSM_BAD_INPUT_TRACE=1` prints each case before it runs (for one that takes the process down).

use crate::common::xla::{
    self, Attr, Buf, Buffer, ByteSpan, Frame, Handler, Scalar, BF16, F16, F32, F64, PRED, S32, S64, U8,
};
use crate::common::{random_cu_seqlens, Dt, Rng};
use std::collections::BTreeMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::mem::{offset_of, size_of};
use std::time::Instant;
use xla_ssm::capi::*;

const S8: i32 = 2;
const S16: i32 = 3;
const U32: i32 = 8;
const ATTR_ARRAY: i32 = 1;
const ATTR_DICTIONARY: i32 = 2;

/// A fieldless enum of mutation kinds and the array of all of them, in order (cases cycle through it).
macro_rules! kinds {
    ($name:ident, $all:ident: $($kind:ident),+ $(,)?) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
        enum $name {
            $($kind),+
        }
        const $all: &[$name] = &[$($name::$kind),+];
    };
}

const DEFAULT_CASES: u64 = 10_000;
const DEFAULT_SEED: u64 = 0x0bad_1a9e;

/// Words that say a shape is wrong (any of them).
const SHAPE: &[&str] =
    &["shape", "rank", "non-negative", "2^48", "dstate", "groups", "width", "slots", "chunk", "checkpoint", "elements"];

// ---------------------------------------------------------------------------------------------
// Settings.

struct Settings {
    cases: u64,
    seed: u64,
    only: Option<u64>,
    trace: bool,
}

fn settings() -> Settings {
    let num = |var: &str| {
        std::env::var(var).ok().map(|v| {
            let v = v.trim();
            let parsed = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => v.parse(),
            };
            parsed.unwrap_or_else(|_| panic!("{var}={v:?} is not a number"))
        })
    };
    Settings {
        cases: num("XLA_SSM_BAD_INPUT_CASES").unwrap_or(DEFAULT_CASES),
        seed: num("XLA_SSM_BAD_INPUT_SEED").unwrap_or(DEFAULT_SEED),
        only: num("XLA_SSM_BAD_INPUT_ONLY"),
        trace: std::env::var_os("XLA_SSM_BAD_INPUT_TRACE").is_some_and(|v| v == "1"),
    }
}

/// The RNG of case `i` of test `salt`: every case can be rerun alone.
fn case_rng(seed: u64, salt: u64, i: u64) -> Rng {
    Rng::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt.wrapping_mul(0xD1B5_4A32_D192_ED03) ^ i)
}

fn below(rng: &mut Rng, n: usize) -> usize {
    (rng.next_u64() % n as u64) as usize
}

fn pick<'a, T>(rng: &mut Rng, xs: &'a [T]) -> &'a T {
    &xs[below(rng, xs.len())]
}

// ---------------------------------------------------------------------------------------------
// The fixture: the calls the Elixir binding emits (see tests/suite/exla_frames.rs for the format).

const FIXTURE: &str = concat!(
    include_str!("../../bindings/elixir/test/fixtures/exla_calls.txt"),
    include_str!("fixtures/carry_calls.txt")
);

#[derive(Clone, Debug)]
struct Entry {
    name: String,
    dtype: i32,
    dims: Vec<i64>,
}

impl Entry {
    fn numel(&self) -> usize {
        self.dims.iter().product::<i64>() as usize
    }

    fn bytes(&self) -> usize {
        self.numel() * elem_size(self.dtype)
    }
}

#[derive(Clone, Debug)]
struct Call {
    id: String,
    target: String,
    attrs: Vec<(String, Attr)>,
    operands: Vec<Entry>,
    results: Vec<Entry>,
}

fn dtype_code(name: &str) -> i32 {
    match name {
        "f32" => F32,
        "bf16" => BF16,
        "f16" => F16,
        "s32" => S32,
        "u8" => U8,
        other => panic!("fixture: unknown dtype {other:?}"),
    }
}

/// MLIR attribute text as XLA converts it (the forms the binding writes; tests/suite/exla_frames.rs checks
/// the conversion itself).
fn parse_attr(text: &str) -> Attr {
    match text {
        "true" => return Attr::Bool(true),
        "false" => return Attr::Bool(false),
        _ => {}
    }
    if let Some(s) = text.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
        assert!(!s.contains('\\'), "fixture: escapes in {text:?}");
        return Attr::Str(s.to_string());
    }
    let (value, ty) = text.split_once(" : ").unwrap_or_else(|| panic!("fixture: attribute {text:?}"));
    match ty {
        "i64" => Attr::Scalar(S64, value.parse::<i64>().unwrap().to_le_bytes().to_vec()),
        "f32" => {
            let bits = match value.strip_prefix("0x") {
                Some(hex) => u32::from_str_radix(hex, 16).unwrap(),
                None => (value.parse::<f64>().unwrap() as f32).to_bits(),
            };
            Attr::Scalar(F32, bits.to_le_bytes().to_vec())
        }
        other => panic!("fixture: attribute type {other}"),
    }
}

fn parse_entry(rest: &str) -> Entry {
    let mut words = rest.split_whitespace();
    let name = words.next().unwrap().to_string();
    let dtype = dtype_code(words.next().unwrap());
    Entry { name, dtype, dims: words.map(|w| w.parse().unwrap()).collect() }
}

fn fixture_calls() -> Vec<Call> {
    let mut calls = Vec::new();
    let mut current: Option<Call> = None;
    for line in FIXTURE.lines().map(str::trim_end) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
        match (word, current.as_mut()) {
            ("call", None) => {
                current = Some(Call {
                    id: rest.into(),
                    target: String::new(),
                    attrs: vec![],
                    operands: vec![],
                    results: vec![],
                })
            }
            ("target", Some(c)) => c.target = rest.into(),
            ("attr", Some(c)) => {
                let (name, text) = rest.split_once(' ').unwrap();
                c.attrs.push((name.into(), parse_attr(text)));
            }
            ("operand", Some(c)) => c.operands.push(parse_entry(rest)),
            ("result", Some(c)) => c.results.push(parse_entry(rest)),
            ("workspace_bytes", Some(_)) => {}
            ("end", Some(_)) => calls.push(current.take().unwrap()),
            ("size" | "chunk_states_type", None) => {}
            _ => panic!("fixture: unexpected line {line:?}"),
        }
    }
    calls
}

fn elem_size(dtype: i32) -> usize {
    match dtype {
        PRED | S8 | U8 => 1,
        S16 | F16 | BF16 => 2,
        S32 | F32 | U32 => 4,
        S64 | F64 => 8,
        _ => 0,
    }
}

fn float_dt(code: i32) -> Option<Dt> {
    match code {
        F32 => Some(Dt::F32),
        BF16 => Some(Dt::BF16),
        F16 => Some(Dt::F16),
        _ => None,
    }
}

fn capi_dtype(code: i32) -> XlaSsmDtype {
    match code {
        F32 => XLA_SSM_F32,
        BF16 => XLA_SSM_BF16,
        F16 => XLA_SSM_F16,
        other => panic!("dtype {other} has no C API code"),
    }
}

// ---------------------------------------------------------------------------------------------
// The operations and their handlers.

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Op {
    ScanFwd,
    ScanBwd,
    ChunkRecords,
    CarryFwd,
    CarryBwd,
    SsdFwd,
    SsdBwd,
    SsdRecords,
    StateUpdate,
    ConvFwd,
    ConvBwd,
    ConvUpdate,
    Decode,
}

impl Op {
    fn of(target: &str) -> Op {
        match target {
            "xla_ssm_selective_scan_fwd" => Op::ScanFwd,
            "xla_ssm_selective_scan_bwd" => Op::ScanBwd,
            "xla_ssm_selective_scan_chunk_records" => Op::ChunkRecords,
            "xla_ssm_selective_scan_carry_fwd" => Op::CarryFwd,
            "xla_ssm_selective_scan_carry_bwd" => Op::CarryBwd,
            "xla_ssm_ssd_fwd" => Op::SsdFwd,
            "xla_ssm_ssd_bwd" => Op::SsdBwd,
            "xla_ssm_ssd_part_records" => Op::SsdRecords,
            "xla_ssm_selective_state_update" => Op::StateUpdate,
            "xla_ssm_causal_conv1d_fwd" => Op::ConvFwd,
            "xla_ssm_causal_conv1d_bwd" => Op::ConvBwd,
            "xla_ssm_causal_conv1d_update" => Op::ConvUpdate,
            "xla_ssm_mamba_decode_step" => Op::Decode,
            other => panic!("unknown target {other}"),
        }
    }

    /// Whether the target takes a trailing workspace result.
    fn has_workspace(self) -> bool {
        matches!(self, Op::ScanFwd | Op::ScanBwd | Op::SsdFwd | Op::SsdBwd)
    }

    fn is_ssd(self) -> bool {
        matches!(self, Op::SsdFwd | Op::SsdBwd | Op::SsdRecords)
    }
}

/// The (cpu, cuda) handlers of a target, from the library's own list.
fn handlers(target: &str) -> (Handler, Handler) {
    let t = xla_ssm::xla::register::TARGETS
        .iter()
        .find(|t| t.name == target)
        .unwrap_or_else(|| panic!("{target} is not in TARGETS"));
    (t.cpu, t.cuda)
}

/// Whether the CUDA entry points can be called with host pointers here: only where there is no
/// device (they must then fail with an error about CUDA, after the same validation).
fn cuda_calls_allowed() -> bool {
    xla_ssm_cuda_device_count() == 0
}

// ---------------------------------------------------------------------------------------------
// Buffers: one 64-byte aligned arena per call, each buffer in a slot (4x its size, for mutations
// that describe it larger) between canary gaps.

const GAP: usize = 64;
const SPARE_BYTES: usize = 1024;

struct Arena {
    _words: Vec<u64>,
    base: *mut u8,
    len: usize,
}

impl Arena {
    fn new(len: usize) -> Arena {
        let mut words = vec![0u64; len.div_ceil(8) + 8];
        let raw = words.as_mut_ptr() as *mut u8;
        let pad = (64 - raw as usize % 64) % 64;
        // The vector is never resized: the pointer stays valid as long as `_words` lives.
        Arena { base: raw.wrapping_add(pad), _words: words, len }
    }

    fn at(&self, off: usize) -> *mut c_void {
        self.base.wrapping_add(off) as *mut c_void
    }

    fn addr(&self) -> usize {
        self.base as usize
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `base` addresses `len` initialised bytes of `_words` (pad + len < its size).
        unsafe { std::slice::from_raw_parts(self.base, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `self` is borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.base, self.len) }
    }
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    off: usize,
    bytes: usize,
    cap: usize,
}

/// One valid call, its buffers in an arena, and the arena's contents before any call (`template`).
struct Setup {
    call: Call,
    op: Op,
    /// Operands, then results, then a spare (for extra buffers).
    slots: Vec<Slot>,
    template: Vec<u8>,
    arena: Arena,
}

fn canary(i: usize) -> u8 {
    ((i as u32).wrapping_mul(2_654_435_761) >> 24) as u8 ^ 0xA5
}

/// Operand values as a model gives them: A negative, dt and its bias positive, indices a
/// permutation of the pool's slots with a padding row, packed sequences' boundaries valid (an
/// empty sequence among them), the rest standard normal, halved.
fn operand_bytes(call: &Call, e: &Entry, rng: &mut Rng) -> Vec<u8> {
    let n = e.numel();
    if e.dtype == S32 && e.name == "cu_seqlens" {
        let cu = random_cu_seqlens(rng, n - 1, call_seqlen(call) as usize);
        return cu.iter().flat_map(|v| v.to_le_bytes()).collect();
    }
    if e.dtype == S32 {
        let pool = call.operands.iter().find(|o| matches!(o.name.as_str(), "state" | "conv_state" | "ssm_state"));
        let slots = pool.expect("indices come with a pooled state").dims[0] as usize;
        let mut perm: Vec<i32> = (0..slots as i32).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, below(rng, i + 1));
        }
        let mut ix: Vec<i32> = perm.into_iter().cycle().take(n).collect();
        if n > 1 {
            ix[n - 1] = -1;
        }
        return ix.iter().flat_map(|v| v.to_le_bytes()).collect();
    }
    let dt = float_dt(e.dtype).unwrap_or_else(|| panic!("{}: operand {} is not float", call.id, e.name));
    let values: Vec<f32> = (0..n)
        .map(|_| match e.name.as_str() {
            "A" => -rng.range(0.5, 2.0) as f32,
            "delta" | "dt" => rng.range(0.01, 0.5) as f32,
            "delta_bias" | "dt_bias" => rng.range(0.0, 0.3) as f32,
            _ => (0.5 * rng.normal()) as f32,
        })
        .collect();
    dt.encode(&values)
}

/// The sequence length of a call: its first operand's (u or x) in its layout (SSD: (batch, seqlen, ..)).
fn call_seqlen(call: &Call) -> i64 {
    let x = &call.operands[0].dims;
    let bld = call.attrs.iter().any(|(n, a)| n == "layout" && matches!(a, Attr::Str(s) if s == "bld"));
    if bld || call.target.starts_with("xla_ssm_ssd") {
        x[1]
    } else {
        x[2]
    }
}

/// The state operands and results a packed call sizes by num_seqs: the selective scan's
/// (num_seqs, dim, dstate), the conv's (num_seqs, dim, width - 1).
const PACKED_STATES: [&str; 6] =
    ["initial_state", "final_state", "dfinal_state", "dinitial_state", "initial_states", "dinitial_states"];

impl Setup {
    fn new(call: Call, seed: u64) -> Setup {
        let op = Op::of(&call.target);
        let sizes: Vec<usize> = call.operands.iter().chain(&call.results).map(Entry::bytes).collect();
        let mut slots = Vec::new();
        let mut off = GAP;
        for bytes in sizes.iter().copied().chain([SPARE_BYTES]) {
            let cap = (bytes * 4).max(64).next_multiple_of(64);
            slots.push(Slot { off, bytes, cap });
            off += cap + GAP;
        }
        // A tail as large as the largest buffer: a result wrongly placed over the last one stays
        // inside the arena.
        let len = off + sizes.iter().max().unwrap() * 4 + GAP;
        let mut template: Vec<u8> = (0..len).map(canary).collect();
        let mut rng = Rng::new(seed);
        for (e, slot) in call.operands.iter().zip(&slots) {
            let bytes = operand_bytes(&call, e, &mut rng);
            template[slot.off..slot.off + bytes.len()].copy_from_slice(&bytes);
        }
        let arena = Arena::new(len);
        Setup { call, op, slots, template, arena }
    }

    fn n_ops(&self) -> usize {
        self.call.operands.len()
    }

    fn slot(&self, ret: bool, i: usize) -> Slot {
        self.slots[if ret { self.n_ops() + i } else { i }]
    }

    fn spare(&self) -> Slot {
        *self.slots.last().unwrap()
    }

    fn entry(&self, ret: bool, i: usize) -> &Entry {
        if ret {
            &self.call.results[i]
        } else {
            &self.call.operands[i]
        }
    }

    fn name(&self, ret: bool, i: usize) -> String {
        self.entry(ret, i).name.clone()
    }

    fn operand(&self, name: &str) -> Option<usize> {
        self.call.operands.iter().position(|e| e.name == name)
    }

    fn result(&self, name: &str) -> Option<usize> {
        self.call.results.iter().position(|e| e.name == name)
    }

    fn operand_entry(&self, name: &str) -> &Entry {
        &self.call.operands[self.operand(name).unwrap_or_else(|| panic!("{}: no operand {name}", self.call.id))]
    }

    fn ptr(&self, ret: bool, i: usize) -> *mut c_void {
        self.arena.at(self.slot(ret, i).off)
    }

    /// The buffer called `name` (an operand first, else a result) and its slot.
    fn named_slot(&self, name: &str) -> Option<(Slot, *mut c_void)> {
        let (ret, i) = match self.operand(name) {
            Some(i) => (false, i),
            None => (true, self.result(name)?),
        };
        Some((self.slot(ret, i), self.ptr(ret, i)))
    }

    fn attr(&self, name: &str) -> Option<&Attr> {
        self.call.attrs.iter().find(|(n, _)| n == name).map(|(_, a)| a)
    }

    /// The boundaries of a packed call, as its arena holds them.
    fn cu_seqlens(&self) -> Option<Vec<i32>> {
        let slot = self.slots[self.operand("cu_seqlens")?];
        let bytes = &self.template[slot.off..slot.off + slot.bytes];
        Some(bytes.chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap())).collect())
    }

    fn attr_bool(&self, name: &str) -> bool {
        matches!(self.attr(name), Some(Attr::Bool(true)))
    }

    fn attr_i64(&self, name: &str) -> Option<i64> {
        match self.attr(name)? {
            Attr::Scalar(S64, b) => Some(i64::from_le_bytes(b.as_slice().try_into().unwrap())),
            other => panic!("{}: {name} is {other:?}", self.call.id),
        }
    }

    fn attr_f32(&self, name: &str) -> f32 {
        match self.attr(name) {
            Some(Attr::Scalar(F32, b)) => f32::from_le_bytes(b.as_slice().try_into().unwrap()),
            other => panic!("{}: {name} is {other:?}", self.call.id),
        }
    }

    fn bld(&self) -> bool {
        matches!(self.attr("layout"), Some(Attr::Str(s)) if s == "bld")
    }

    /// The unmutated buffers of a frame, in the arena.
    fn base_bufs(&self) -> (Vec<Buf>, Vec<Buf>) {
        let bufs = |ret: bool, entries: &[Entry]| -> Vec<Buf> {
            entries
                .iter()
                .enumerate()
                .map(|(i, e)| Buf { dtype: e.dtype, dims: e.dims.clone(), data: self.ptr(ret, i) })
                .collect()
        };
        (bufs(false, &self.call.operands), bufs(true, &self.call.results))
    }

    fn reset(&mut self) {
        let template = &self.template;
        self.arena.bytes_mut().copy_from_slice(template);
    }

    /// Where arena byte `off` lies, in words.
    fn place(&self, off: usize) -> String {
        let n_ops = self.n_ops();
        for (k, s) in self.slots.iter().enumerate() {
            let what = if k < n_ops {
                format!("operand `{}`", self.call.operands[k].name)
            } else if k - n_ops < self.call.results.len() {
                format!("result `{}`", self.call.results[k - n_ops].name)
            } else {
                "the spare buffer".into()
            };
            if (s.off..s.off + s.bytes).contains(&off) {
                return format!("inside {what} (+{})", off - s.off);
            }
            if (s.off + s.bytes..s.off + s.cap + GAP).contains(&off) {
                return format!("in the canary past {what} (+{})", off - s.off);
            }
        }
        if off < GAP {
            "in the canary before the first buffer".into()
        } else {
            "in the arena's tail".into()
        }
    }

    /// Every byte outside `allowed` (address, length) is as before the call.
    fn check_writes(&self, allowed: &[(usize, usize)]) -> Result<(), String> {
        let (base, len) = (self.arena.addr(), self.arena.len);
        let mut ranges: Vec<(usize, usize)> = allowed
            .iter()
            .filter(|&&(_, n)| n > 0)
            .map(|&(a, n)| {
                let lo = a.saturating_sub(base).min(len);
                let hi = a.saturating_add(n).saturating_sub(base).min(len);
                (lo, hi)
            })
            .filter(|(lo, hi)| lo < hi)
            .collect();
        ranges.sort();
        let (now, before) = (self.arena.bytes(), &self.template);
        let compare = |lo: usize, hi: usize| -> Result<(), String> {
            if now[lo..hi] == before[lo..hi] {
                return Ok(());
            }
            let at = (lo..hi).find(|&i| now[i] != before[i]).unwrap();
            Err(format!("wrote arena byte {at} {}, outside its results", self.place(at)))
        };
        let mut pos = 0;
        for (lo, hi) in ranges {
            if lo > pos {
                compare(pos, lo)?;
            }
            pos = pos.max(hi);
        }
        compare(pos, len)
    }
}

// ---------------------------------------------------------------------------------------------
// Expectations and outcomes.

/// Groups of words: the message must contain one word of every group (case-blind).
type Needles = Vec<Vec<String>>;

#[derive(Clone, Debug)]
enum Expect {
    /// Succeeds (a CUDA entry point without a device: refuses with an error about CUDA).
    Ok,
    /// INVALID_ARGUMENT with these words.
    Invalid(Needles),
    /// Either of the two.
    Either(Needles),
    /// INVALID_ARGUMENT with these words from a host entry point, which reads the operands' values;
    /// a CUDA one cannot read them before it runs, so it succeeds (refuses without a device).
    HostValues(Needles),
    /// Returns no error and does nothing (other stages; no API table to report through).
    Nothing,
    /// The host's own error, passed on (INTERNAL with this text).
    HostError(&'static str),
}

fn words(ws: &[&str]) -> Vec<String> {
    ws.iter().map(|w| w.to_string()).collect()
}

/// The name as messages quote it: `name` (or `name (result)` and the like).
fn named(name: &str) -> Vec<String> {
    vec![format!("`{name}`"), format!("`{name} (")]
}

fn invalid(groups: &[&[&str]]) -> Expect {
    Expect::Invalid(groups.iter().map(|g| words(g)).collect())
}

fn invalid_named(name: &str, groups: &[&[&str]]) -> Expect {
    let mut n: Needles = vec![named(name)];
    n.extend(groups.iter().map(|g| words(g)));
    Expect::Invalid(n)
}

fn either(groups: &[&[&str]]) -> Expect {
    Expect::Either(groups.iter().map(|g| words(g)).collect())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Code {
    Invalid,
    Unimplemented,
    Cuda,
    Internal,
    Other(i32),
}

#[derive(Debug)]
enum Outcome {
    Ok,
    Err(Code, String),
}

fn matches_needles(msg: &str, needles: &Needles) -> bool {
    let msg = msg.to_lowercase();
    needles.iter().all(|group| group.iter().any(|w| msg.contains(&w.to_lowercase())))
}

/// A CUDA entry point's refusal on a machine without a device: an error about CUDA (the driver, or
/// what the CUDA path needs that a CPU-only fixture leaves out, such as a workspace).
fn cuda_refusal(code: Code, msg: &str) -> bool {
    matches!(code, Code::Unimplemented | Code::Cuda | Code::Internal | Code::Invalid)
        && msg.to_lowercase().contains("cuda")
}

/// Whether `outcome` is what `expect` allows; Ok(true) when the call may have written its results.
fn judge(expect: &Expect, cuda: bool, outcome: &Outcome) -> Result<bool, String> {
    if let Outcome::Err(_, msg) = outcome {
        if msg.contains("panicked") {
            return Err("the library panicked (a missing check)".into());
        }
    }
    if let Expect::HostValues(n) = expect {
        let as_called = if cuda { Expect::Ok } else { Expect::Invalid(n.clone()) };
        return judge(&as_called, cuda, outcome);
    }
    let fail = |why: &str| Err(format!("{why}: expected {expect:?}"));
    match (expect, outcome) {
        (Expect::Nothing, Outcome::Ok) => Ok(false),
        (Expect::Ok | Expect::Either(_), Outcome::Ok) if !cuda => Ok(true),
        // An empty call has nothing to launch: a CUDA entry point may take it without a device.
        (Expect::Either(_), Outcome::Ok) => Ok(true),
        (Expect::Ok | Expect::Either(_), Outcome::Err(code, msg)) if cuda && cuda_refusal(*code, msg) => Ok(false),
        (Expect::Invalid(n) | Expect::Either(n), Outcome::Err(Code::Invalid, msg)) => {
            if matches_needles(msg, n) {
                Ok(false)
            } else {
                fail("the message does not name the problem")
            }
        }
        (Expect::HostError(text), Outcome::Err(Code::Internal, msg)) if msg.contains(text) => Ok(false),
        (_, Outcome::Err(Code::Internal, _)) => fail("INTERNAL (a missing check)"),
        (_, Outcome::Ok) if cuda => fail("a CUDA entry point succeeded without a device"),
        _ => fail("wrong outcome"),
    }
}

/// Counts of what a test's cases did, and its failures.
#[derive(Default)]
struct Tally {
    cases: u64,
    by_kind: BTreeMap<String, [u64; 3]>,
    by_target: BTreeMap<String, u64>,
    failures: Vec<String>,
}

impl Tally {
    fn record(&mut self, kind: &str, target: &str, outcome: &Outcome) {
        self.cases += 1;
        let k = match outcome {
            Outcome::Ok => 0,
            Outcome::Err(Code::Invalid, _) => 1,
            Outcome::Err(..) => 2,
        };
        self.by_kind.entry(kind.to_string()).or_default()[k] += 1;
        *self.by_target.entry(target.to_string()).or_default() += 1;
    }

    fn fail(&mut self, msg: String) {
        if self.failures.len() < 40 {
            eprintln!("FAIL {msg}");
        }
        self.failures.push(msg);
    }

    fn finish(&self, test: &str, start: Instant, s: &Settings) {
        println!("{test}: {} cases in {:.2?} (seed {:#x})", self.cases, start.elapsed(), s.seed);
        println!("  {:<26} {:>6} {:>8} {:>6}", "mutation", "ok", "invalid", "other");
        for (kind, [ok, inv, other]) in &self.by_kind {
            println!("  {kind:<26} {ok:>6} {inv:>8} {other:>6}");
        }
        for (target, n) in &self.by_target {
            println!("  {target:<40} {n:>6}");
        }
        assert!(
            self.failures.is_empty(),
            "{test}: {} of {} cases failed (seed {:#x}; rerun one with XLA_SSM_BAD_INPUT_ONLY=<case>):\n{}",
            self.failures.len(),
            self.cases,
            s.seed,
            self.failures.iter().take(40).cloned().collect::<Vec<_>>().join("\n")
        );
    }
}

// ---------------------------------------------------------------------------------------------
// XLA call frames.

kinds!(
    XKind, XKINDS:
    Baseline, FrameSize, NullApi, ApiSize, ApiMajor, OtherStage, NegativeCount, NullArray,
    NotABuffer, NullBuffer, BufferSize, BadRank, NullDims, RankChange, DimChange, NegativeDim,
    HugeDims, DtypeChange, NullData, Misaligned, ResultOverlaps, AliasExact, AliasPartial,
    SharedOperands, DropOperand, ExtraOperand, DropResult, ExtraResult, AttrMissing, AttrRenamed,
    AttrExtra, AttrWrongType, AttrNullEntry, AttrNullName, AttrTypeCode, AttrNullValue,
    AttrBoolFlip, AttrBoolOdd, AttrIntValue, AttrFloatValue, AttrStrValue, StreamFails, MetadataOk,
    MetadataBad, BoundaryValues,
);

type Tweak = Box<dyn FnOnce(&mut Frame)>;

/// One frame case: the buffers and attributes to build the frame from, a tweak of the built frame,
/// or a metadata request (extension struct size, null metadata, metadata struct size).
struct XCase {
    args: Vec<Buf>,
    rets: Vec<Buf>,
    attrs: Vec<(String, Attr)>,
    tweak: Option<Tweak>,
    metadata: Option<(usize, bool, usize)>,
    /// Host memory an operand was pointed at (outside the arena: the arena's bytes stay as the
    /// template has them), kept alive through the call.
    _keep: Option<Vec<i32>>,
    expect: Expect,
    what: String,
}

/// Operand or result `i`'s `XLA_FFI_Buffer` in a built frame.
fn poke_buffer(f: &mut Frame, ret: bool, i: usize, edit: impl FnOnce(&mut Buffer)) {
    // SAFETY: the frame's lists hold `size` pointers to the Buffer structs the frame owns, and
    // i < size (the case picked an existing buffer).
    unsafe {
        let list = if ret { f.raw.rets.rets } else { f.raw.args.args };
        edit(&mut *(*list.add(i) as *mut Buffer));
    }
}

/// The index of attribute `name` in a built frame (which sorts them).
fn attr_index(f: &Frame, name: &str) -> usize {
    let attrs = &f.raw.attrs;
    (0..attrs.size as usize)
        .find(|&i| {
            // SAFETY: the frame's name array holds `size` spans of bytes it owns.
            unsafe {
                let span = &**attrs.names.add(i);
                std::slice::from_raw_parts(span.ptr as *const u8, span.len) == name.as_bytes()
            }
        })
        .unwrap_or_else(|| panic!("attribute {name} is not in the frame"))
}

/// Every buffer (result?, index) that passes `keep`.
fn buffers_where(s: &Setup, keep: impl Fn(bool, usize, &Entry) -> bool) -> Vec<(bool, usize)> {
    let ops = (0..s.call.operands.len()).map(|i| (false, i));
    let rets = (0..s.call.results.len()).map(|i| (true, i));
    ops.chain(rets).filter(|&(r, i)| keep(r, i, s.entry(r, i))).collect()
}

fn pick_buffer(s: &Setup, rng: &mut Rng, keep: impl Fn(bool, usize, &Entry) -> bool) -> Option<(bool, usize)> {
    let all = buffers_where(s, keep);
    (!all.is_empty()).then(|| *pick(rng, &all))
}

fn kind_word(ret: bool) -> &'static str {
    if ret {
        "result"
    } else {
        "operand"
    }
}

/// The in-place operands of a target (each aliased by the result of the same name).
fn in_place(op: Op) -> &'static [&'static str] {
    match op {
        Op::StateUpdate => &["state"],
        Op::CarryFwd => &["out"],
        Op::ConvUpdate => &["conv_state"],
        Op::Decode => &["conv_state", "ssm_state"],
        _ => &[],
    }
}

/// What one buffer with other dims (and the rest as they were) makes of the call.
fn shape_expect(s: &Setup, ret: bool, i: usize, dims: &[i64]) -> Expect {
    let name = s.name(ret, i);
    if ret && name == "workspace" {
        return Expect::Ok; // any size: the CPU never touches it
    }
    if !ret && name == "cu_seqlens" {
        if dims.len() != 1 || dims[0] < 1 {
            return invalid_named("cu_seqlens", &[&["shape"]]);
        }
        // Another num_seqs: the states, sized by it, no longer match.
        if PACKED_STATES.iter().any(|n| s.named_slot(n).is_some()) {
            return invalid(&[SHAPE]);
        }
        // No state to disagree: the boundaries read, a prefix of the arena's or past them.
        return Expect::Either(vec![named("cu_seqlens")]);
    }
    if s.op == Op::ConvFwd && !ret && name == "weight" && s.operand("initial_states").is_none() {
        let w = &s.operand_entry("weight").dims;
        if dims.len() == 2 && dims[0] == w[0] && (2..=4).contains(&dims[1]) {
            return either(&[SHAPE]); // another width, and nothing else sized by it
        }
    }
    if s.op == Op::SsdRecords && !ret && name == "B" && dims.len() == 4 {
        // B without C: another group count dividing heads is another valid call.
        let (b, heads) = (&s.operand_entry("B").dims, s.operand_entry("x").dims[2]);
        if (0..4).all(|k| k == 2 || dims[k] == b[k]) && dims[2] >= 1 && heads % dims[2] == 0 {
            return either(&[SHAPE]);
        }
    }
    let lone_bc = match s.op {
        Op::CarryFwd | Op::CarryBwd => "C",
        Op::ChunkRecords => "B",
        _ => "",
    };
    if !ret && name == lone_bc && dims.len() == 4 {
        // The carry targets take C without B, the records B without C: another group count
        // dividing dim is another valid call.
        let (c, g) = (&s.operand_entry(lone_bc).dims, if s.bld() { 2 } else { 1 });
        let dim = s.operand_entry("A").dims[0];
        let others_kept = (0..4).all(|k| k == g || dims[k] == c[k]);
        if others_kept && dims[g] >= 1 && dim % dims[g] == 0 {
            return either(&[SHAPE]);
        }
    }
    if s.op == Op::SsdFwd && !ret && name == "D" {
        let x = s.operand_entry("x");
        if dims == [x.dims[2]] || dims == [x.dims[2], x.dims[3]] {
            return either(&[SHAPE]); // D is (heads) or (heads, headdim)
        }
    }
    invalid(&[SHAPE])
}

/// What one buffer of another dtype makes of the call.
fn dtype_expect(s: &Setup, ret: bool, i: usize, dtype: i32) -> Expect {
    let name = s.name(ret, i);
    if ret && name == "workspace" {
        return Expect::Ok;
    }
    if !ret && name == "cu_seqlens" {
        return invalid_named("cu_seqlens", &[&["dtype"]]);
    }
    let weight =
        matches!((s.op, name.as_str()), (Op::ConvFwd | Op::ConvUpdate, "weight") | (Op::Decode, "conv_weight"));
    let bias = s.operand("bias").is_some() || s.operand("conv_bias").is_some();
    if !ret && weight && !bias && (dtype == F32 || dtype == s.operand_entry("x").dtype) {
        return Expect::Ok; // the weight is f32 or x's dtype; the bias would have to match it
    }
    let lone_bc = match s.op {
        Op::CarryFwd | Op::CarryBwd => name == "C",
        Op::ChunkRecords => name == "B",
        _ => false,
    };
    if !ret && lone_bc && (dtype == F32 || dtype == s.operand_entry("delta").dtype) {
        return Expect::Ok; // C without B (B without C): f32 or the inputs' dtype, as the scan's B and C
    }
    invalid(&[&["dtype"]])
}

/// The sequence length of a selective scan call.
fn scan_seqlen(s: &Setup) -> i64 {
    let u = &s.operand_entry("u").dims;
    if s.bld() {
        u[1]
    } else {
        u[2]
    }
}

/// What the call makes of attribute `name` missing (or unreadable as a name).
fn missing_expect(s: &Setup, name: &str) -> Expect {
    if name == "has_cu_seqlens" || name == "has_chunk_records" || name == "has_part_records" {
        // Optional (false: not packed, no records): that operand is then one too many.
        return invalid(&[&["operands"]]);
    }
    if s.op == Op::ScanFwd && name == "checkpoint_len" {
        // Optional (0: no checkpoints). A checkpoints result then reads as the workspace.
        return match (s.result("checkpoints").is_some(), s.result("workspace").is_some()) {
            (true, true) => invalid(&[&["results"]]),
            _ => Expect::Ok,
        };
    }
    invalid_named(name, &[&["missing"]])
}

/// What the call makes of attribute `name` called `new_name` instead: a required one is missing; an
/// optional one's new name is an attribute the target does not read.
fn renamed_expect(s: &Setup, name: &str, new_name: &str) -> Expect {
    let optional_flag = ["has_cu_seqlens", "has_chunk_records", "has_part_records"].contains(&name);
    if (s.op == Op::ScanFwd && name == "checkpoint_len") || optional_flag {
        return invalid_named(new_name, &[&["unknown attribute"]]);
    }
    missing_expect(s, name)
}

/// What the call makes of `checkpoint_len` = v.
/// The carry calls' `segment_len` = v: the same number of segments (as `dt_sums` has) or an error.
fn segment_len_expect(s: &Setup, orig: i64, v: i64) -> Expect {
    if v < 1 {
        return invalid_named("segment_len", &[]);
    }
    let x = &s.call.operands[0];
    let seqlen = if s.bld() { x.dims[1] } else { x.dims[2] };
    let segments = |len: i64| if seqlen == 0 { 0 } else { (seqlen - 1) / len + 1 };
    if segments(v) == segments(orig) {
        Expect::Ok
    } else {
        invalid_named("dt_sums", &[])
    }
}

fn checkpoint_len_expect(s: &Setup, v: i64) -> Expect {
    let fwd = s.op == Op::ScanFwd;
    if v < 0 || v % 32 != 0 || (!fwd && v == 0) {
        return invalid_named("checkpoint_len", &[]);
    }
    if fwd && v == 0 {
        return missing_expect(s, "checkpoint_len");
    }
    let checkpoints = if fwd {
        match s.result("checkpoints") {
            Some(i) => &s.call.results[i],
            None => return invalid(&[&["results", "checkpoints", "shape", "dtype"]]),
        }
    } else {
        s.operand_entry("checkpoints")
    };
    let seqlen = scan_seqlen(s);
    let n = seqlen / v + (seqlen % v != 0) as i64;
    if n == checkpoints.dims[2] {
        Expect::Ok
    } else {
        invalid(&[&["checkpoints"]])
    }
}

/// Whether dt limits are accepted: dt_min <= dt_max, neither NaN, dt_min < inf, dt_max > -inf.
fn dt_limits_ok(lo: f32, hi: f32) -> bool {
    lo <= hi && lo < f32::INFINITY && hi > f32::NEG_INFINITY
}

const ODD_FLOATS: [f32; 8] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, 0.5, 1e30, -1e30, -0.25];

fn scalar_i64(dtype: i32, v: i64) -> Attr {
    let bytes = match dtype {
        S8 => (v as i8).to_le_bytes().to_vec(),
        S16 => (v as i16).to_le_bytes().to_vec(),
        S32 | U32 => (v as i32).to_le_bytes().to_vec(),
        U8 | PRED => vec![v as u8],
        _ => v.to_le_bytes().to_vec(),
    };
    Attr::Scalar(dtype, bytes)
}

fn gen_xla(kind: XKind, s: &Setup, rng: &mut Rng) -> Option<XCase> {
    use XKind::*;
    let (mut args, mut rets) = s.base_bufs();
    let mut attrs = s.call.attrs.clone();
    let mut tweak: Option<Tweak> = None;
    let mut metadata = None;
    let mut keep = None;
    let (what, expect): (String, Expect) = match kind {
        Baseline => ("unchanged".into(), Expect::Ok),
        FrameSize => {
            let size = *pick(rng, &[0usize, 8, 100, 160, 167]);
            tweak = Some(Box::new(move |f: &mut Frame| f.raw.struct_size = size));
            (format!("call frame struct_size {size}"), invalid(&[&["XLA_FFI_CallFrame"]]))
        }
        NullApi => {
            tweak = Some(Box::new(|f: &mut Frame| f.raw.api = std::ptr::null()));
            ("no API table".into(), Expect::Nothing)
        }
        ApiSize => {
            let size = *pick(rng, &[0usize, 48, 80, 87]);
            tweak = Some(Box::new(move |f: &mut Frame| f.api.struct_size = size));
            (format!("API table struct_size {size}"), invalid(&[&["XLA_FFI_Api"]]))
        }
        ApiMajor => {
            let major = *pick(rng, &[1, -1, 7]);
            tweak = Some(Box::new(move |f: &mut Frame| f.api.api_version.major_version = major));
            (format!("API version {major}.3"), invalid(&[&["version"]]))
        }
        OtherStage => {
            let stage = *pick(rng, &[0, 1, 2, -1, 4, i32::MAX]);
            tweak = Some(Box::new(move |f: &mut Frame| f.raw.stage = stage));
            (format!("stage {stage}"), Expect::Nothing)
        }
        NegativeCount => {
            let which = below(rng, 3);
            let size = *pick(rng, &[-1i64, -7, i64::MIN]);
            tweak = Some(Box::new(move |f: &mut Frame| match which {
                0 => f.raw.args.size = size,
                1 => f.raw.rets.size = size,
                _ => f.raw.attrs.size = size,
            }));
            let word = ["operands", "results", "attributes"][which];
            (format!("{size} {word}"), invalid(&[&["negative number of"], &[word]]))
        }
        NullArray => {
            let which = below(rng, 7);
            tweak = Some(Box::new(move |f: &mut Frame| {
                let r = &mut f.raw;
                match which {
                    0 => r.args.types = std::ptr::null_mut(),
                    1 => r.args.args = std::ptr::null_mut(),
                    2 => r.rets.types = std::ptr::null_mut(),
                    3 => r.rets.rets = std::ptr::null_mut(),
                    4 => r.attrs.types = std::ptr::null_mut(),
                    5 => r.attrs.names = std::ptr::null_mut(),
                    _ => r.attrs.attrs = std::ptr::null_mut(),
                }
            }));
            let word = ["operands", "operands", "results", "results", "attributes", "attributes", "attributes"][which];
            (format!("null array #{which} of the {word}"), invalid(&[&["null array"], &[word]]))
        }
        NotABuffer => {
            let (ret, i) = pick_buffer(s, rng, |_, _, _| true)?;
            let ty = *pick(rng, &[0, 2, 99, -1]);
            tweak = Some(Box::new(move |f: &mut Frame| {
                let types = if ret { f.raw.rets.types } else { f.raw.args.types };
                // SAFETY: i < size of the frame's type array.
                unsafe { *types.add(i) = ty };
            }));
            let name = s.name(ret, i);
            (format!("{} `{name}` of type {ty}", kind_word(ret)), invalid_named(&name, &[&["not a buffer"]]))
        }
        NullBuffer => {
            let (ret, i) = pick_buffer(s, rng, |_, _, _| true)?;
            tweak = Some(Box::new(move |f: &mut Frame| {
                let list = if ret { f.raw.rets.rets } else { f.raw.args.args };
                // SAFETY: i < size of the frame's pointer array.
                unsafe { *list.add(i) = std::ptr::null_mut() };
            }));
            let name = s.name(ret, i);
            (format!("{} `{name}` a null XLA_FFI_Buffer", kind_word(ret)), invalid_named(&name, &[&["null buffer"]]))
        }
        BufferSize => {
            let (ret, i) = pick_buffer(s, rng, |_, _, _| true)?;
            let size = *pick(rng, &[0usize, 8, 40, 47]);
            tweak = Some(Box::new(move |f: &mut Frame| poke_buffer(f, ret, i, |b| b.struct_size = size)));
            let name = s.name(ret, i);
            (
                format!("{} `{name}` struct_size {size}", kind_word(ret)),
                invalid_named(&name, &[&["XLA_FFI_Buffer size"]]),
            )
        }
        BadRank => {
            let (ret, i) = pick_buffer(s, rng, |_, _, _| true)?;
            let rank = *pick(rng, &[-1i64, 9, 100, i64::MAX, i64::MIN]);
            tweak = Some(Box::new(move |f: &mut Frame| poke_buffer(f, ret, i, |b| b.rank = rank)));
            let name = s.name(ret, i);
            (format!("{} `{name}` rank {rank}", kind_word(ret)), invalid_named(&name, &[&["rank"]]))
        }
        NullDims => {
            let (ret, i) = pick_buffer(s, rng, |_, _, e| !e.dims.is_empty())?;
            tweak = Some(Box::new(move |f: &mut Frame| poke_buffer(f, ret, i, |b| b.dims = std::ptr::null_mut())));
            let name = s.name(ret, i);
            (format!("{} `{name}` without dims", kind_word(ret)), invalid_named(&name, &[&["no dimensions"]]))
        }
        RankChange => {
            let (ret, i) = pick_buffer(s, rng, |_, _, _| true)?;
            let mut dims = s.entry(ret, i).dims.clone();
            if dims.len() < 8 && (dims.is_empty() || below(rng, 2) == 0) {
                let at = below(rng, dims.len() + 1);
                dims.insert(at, *pick(rng, &[0, 1, 2, 7]));
            } else {
                dims.remove(below(rng, dims.len()));
            }
            let expect = shape_expect(s, ret, i, &dims);
            let buf = if ret { &mut rets[i] } else { &mut args[i] };
            buf.dims = dims.clone();
            (format!("{} `{}` dims {dims:?}", kind_word(ret), s.name(ret, i)), expect)
        }
        DimChange => {
            let (ret, i) = pick_buffer(s, rng, |_, _, e| !e.dims.is_empty())?;
            let mut dims = s.entry(ret, i).dims.clone();
            let j = below(rng, dims.len());
            let orig = dims[j];
            let choices = [0, 1, orig - 1, orig + 1, orig * 2, below(rng, 300) as i64];
            let v = *pick(rng, &choices);
            if v == orig || v < 0 {
                return None;
            }
            dims[j] = v;
            let expect = shape_expect(s, ret, i, &dims);
            let buf = if ret { &mut rets[i] } else { &mut args[i] };
            buf.dims = dims.clone();
            (format!("{} `{}` dims {dims:?}", kind_word(ret), s.name(ret, i)), expect)
        }
        NegativeDim => {
            let (ret, i) = pick_buffer(s, rng, |_, _, e| !e.dims.is_empty())?;
            let mut dims = s.entry(ret, i).dims.clone();
            let j = below(rng, dims.len());
            dims[j] = *pick(rng, &[-1, i64::MIN, -dims[j].max(1)]);
            let buf = if ret { &mut rets[i] } else { &mut args[i] };
            buf.dims = dims.clone();
            let name = s.name(ret, i);
            (format!("{} `{name}` dims {dims:?}", kind_word(ret)), invalid_named(&name, &[&["non-negative"]]))
        }
        HugeDims => {
            let (ret, i) = pick_buffer(s, rng, |_, _, e| !e.dims.is_empty())?;
            let mut dims = s.entry(ret, i).dims.clone();
            let j = below(rng, dims.len());
            if dims.len() >= 2 && below(rng, 2) == 0 {
                // Two dims whose product overflows an i64.
                let k = (j + 1) % dims.len();
                dims[j] = 1 << 32;
                dims[k] = (1 << 32) + 1;
            } else {
                dims[j] = *pick(rng, &[1i64 << 49, 1 << 62, i64::MAX]);
            }
            let buf = if ret { &mut rets[i] } else { &mut args[i] };
            buf.dims = dims.clone();
            let name = s.name(ret, i);
            (format!("{} `{name}` dims {dims:?}", kind_word(ret)), invalid_named(&name, &[&["2^48"]]))
        }
        DtypeChange => {
            let (ret, i) = pick_buffer(s, rng, |_, _, _| true)?;
            let dtype = *pick(rng, &[PRED, S8, S16, S32, S64, U8, F16, F32, F64, BF16, 0, 7, 99, -1]);
            if dtype == s.entry(ret, i).dtype {
                return None;
            }
            let expect = dtype_expect(s, ret, i, dtype);
            let buf = if ret { &mut rets[i] } else { &mut args[i] };
            buf.dtype = dtype;
            (format!("{} `{}` dtype {dtype}", kind_word(ret), s.name(ret, i)), expect)
        }
        NullData => {
            let (ret, i) = pick_buffer(s, rng, |_, _, e| e.numel() > 0)?;
            let buf = if ret { &mut rets[i] } else { &mut args[i] };
            buf.data = std::ptr::null_mut();
            let name = s.name(ret, i);
            let expect = if name == "workspace" {
                either(&[&["workspace"], &["null"]])
            } else {
                invalid_named(&name, &[&["null"]])
            };
            (format!("{} `{name}` null data", kind_word(ret)), expect)
        }
        Misaligned => {
            let (ret, i) = pick_buffer(s, rng, |_, _, e| elem_size(e.dtype) > 1 && e.numel() > 0)?;
            let k = 1 + below(rng, elem_size(s.entry(ret, i).dtype) - 1);
            let buf = if ret { &mut rets[i] } else { &mut args[i] };
            buf.data = (buf.data as *mut u8).wrapping_add(k) as *mut c_void;
            let name = s.name(ret, i);
            (format!("{} `{name}` data + {k}", kind_word(ret)), invalid_named(&name, &[&["align"]]))
        }
        ResultOverlaps => {
            let (_, n) = pick_buffer(s, rng, |r, _, e| r && e.bytes() > 64)?;
            let (mret, m) = pick_buffer(s, rng, |r, j, e| e.bytes() > 0 && !(r && j == n))?;
            let (target, bytes) = (s.ptr(mret, m) as usize, s.entry(mret, m).bytes());
            let at = if below(rng, 3) == 0 {
                target - 64 // from just before it, into it
            } else {
                target + 64 * below(rng, bytes.div_ceil(64))
            };
            rets[n].data = at as *mut c_void;
            let what = format!(
                "result `{}` at {:+} bytes of {} `{}`",
                s.name(true, n),
                at as isize - target as isize,
                kind_word(mret),
                s.name(mret, m)
            );
            // An in-place state's result exactly on its operand is the aliasing XLA may do.
            let name = s.name(true, n);
            let aliased = !mret && at == target && s.name(false, m) == name && in_place(s.op).contains(&name.as_str());
            (what, if aliased { Expect::Ok } else { invalid(&[&["overlap"]]) })
        }
        AliasExact | AliasPartial => {
            let name = *pick(rng, in_place(s.op).first().map(|_| in_place(s.op))?);
            let (i, n) = (s.operand(name)?, s.result(name)?);
            let e = &s.call.operands[i];
            let data = s.ptr(false, i) as usize;
            let at = if kind == AliasExact {
                data
            } else {
                let k = elem_size(e.dtype) * (1 + below(rng, e.numel() - 1));
                if below(rng, 2) == 0 {
                    data + k
                } else {
                    data - k.min(64)
                }
            };
            rets[n].data = at as *mut c_void;
            let what = format!("result `{name}` at {:+} bytes of operand `{name}`", at as isize - data as isize);
            let expect = if kind == AliasExact { Expect::Ok } else { invalid_named(name, &[&["overlap"]]) };
            (what, expect)
        }
        SharedOperands => {
            // Indices and boundaries must keep their values: not another operand's bytes.
            let (_, n) =
                pick_buffer(s, rng, |r, _, e| !r && e.name != "state_batch_indices" && e.name != "cu_seqlens")?;
            let need = s.call.operands[n].bytes();
            let (_, m) = pick_buffer(s, rng, |r, j, e| !r && j != n && e.bytes() >= need)?;
            args[n].data = args[m].data;
            (format!("operand `{}` shares operand `{}`'s buffer", s.name(false, n), s.name(false, m)), Expect::Ok)
        }
        DropOperand => {
            let i = below(rng, args.len());
            args.remove(i);
            (format!("operand `{}` left out", s.name(false, i)), invalid(&[&["operands"]]))
        }
        ExtraOperand => {
            let i = below(rng, args.len() + 1);
            args.insert(i, Buf { dtype: F32, dims: vec![4], data: s.arena.at(s.spare().off) });
            (format!("an extra operand at {i}"), invalid(&[&["operands"]]))
        }
        DropResult => {
            let i = below(rng, rets.len());
            rets.remove(i);
            let name = s.name(true, i);
            let expect = if name == "workspace" {
                Expect::Ok
            } else if s.op.has_workspace() {
                invalid(&[&["results", "shape", "dtype", "rank"]])
            } else {
                invalid(&[&["results"]])
            };
            (format!("result `{name}` left out"), expect)
        }
        ExtraResult => {
            let spare = Buf { dtype: U8, dims: vec![256], data: s.arena.at(s.spare().off) };
            if s.op.has_workspace() && s.result("workspace").is_none() {
                rets.push(spare);
                ("a workspace result".into(), Expect::Ok)
            } else {
                let i = below(rng, rets.len() + 1);
                rets.insert(i, spare);
                (format!("an extra result at {i}"), invalid(&[&["results", "shape", "dtype", "rank"]]))
            }
        }
        AttrMissing => {
            let k = below(rng, attrs.len());
            let (name, _) = attrs.remove(k);
            (format!("attribute {name} left out"), missing_expect(s, &name))
        }
        AttrRenamed => {
            let k = below(rng, attrs.len());
            let name = attrs[k].0.clone();
            let renamed = match below(rng, 4) {
                0 => format!("{name}_"),
                1 => name.to_uppercase(),
                2 => name[..name.len() - 1].to_string(),
                _ => format!(" {name}"),
            };
            attrs[k].0 = renamed.clone();
            (format!("attribute {name} renamed {renamed:?}"), renamed_expect(s, &name, &renamed))
        }
        AttrExtra => {
            let value = match below(rng, 3) {
                0 => Attr::Bool(true),
                1 => Attr::Str("extra".into()),
                _ => scalar_i64(S64, -5),
            };
            let name = *pick(rng, &["zz_unknown", "a_extra", "has_w", "layouts"]);
            attrs.push((name.into(), value));
            (format!("an extra attribute {name}"), invalid_named(name, &[&["unknown attribute"]]))
        }
        AttrWrongType => {
            let k = below(rng, attrs.len());
            let (name, orig) = attrs[k].clone();
            let (new, expect) = match orig {
                Attr::Bool(b) => {
                    let new = match below(rng, 5) {
                        0 => scalar_i64(S64, b as i64),
                        1 => scalar_i64(S32, b as i64),
                        2 => scalar_i64(U8, b as i64),
                        3 => Attr::Scalar(F32, (b as i32 as f32).to_le_bytes().to_vec()),
                        _ => Attr::Str(b.to_string()),
                    };
                    (new, invalid_named(&name, &[&["bool"]]))
                }
                Attr::Str(ref v) => {
                    let new = if below(rng, 2) == 0 { Attr::Bool(true) } else { scalar_i64(S64, v.len() as i64) };
                    (new, invalid_named(&name, &[&["string"]]))
                }
                Attr::Scalar(S64, ref bytes) => {
                    let v = i64::from_le_bytes(bytes.as_slice().try_into().unwrap());
                    let narrow = *pick(rng, &[S32, S16, S8]);
                    let fits = match narrow {
                        S32 => i32::try_from(v).is_ok(),
                        S16 => i16::try_from(v).is_ok(),
                        _ => i8::try_from(v).is_ok(),
                    };
                    match below(rng, 5) {
                        0 if fits => (scalar_i64(narrow, v), Expect::Ok), // any signed width is taken
                        0 | 1 => (scalar_i64(U32, v), invalid_named(&name, &[&["integer"]])),
                        2 => (Attr::Bool(v != 0), invalid_named(&name, &[&["integer"]])),
                        3 => (Attr::Str(v.to_string()), invalid_named(&name, &[&["integer"]])),
                        _ => (
                            Attr::Scalar(F64, (v as f64).to_le_bytes().to_vec()),
                            invalid_named(&name, &[&["integer"]]),
                        ),
                    }
                }
                Attr::Scalar(F32, ref bytes) => {
                    let v = f32::from_le_bytes(bytes.as_slice().try_into().unwrap());
                    match below(rng, 4) {
                        0 => (Attr::Scalar(F64, (v as f64).to_le_bytes().to_vec()), Expect::Ok), // rounded back
                        1 => (scalar_i64(S64, v as i64), invalid_named(&name, &[&["f32", "float"]])),
                        2 => (Attr::Bool(true), invalid_named(&name, &[&["f32", "float"]])),
                        _ => (Attr::Str(v.to_string()), invalid_named(&name, &[&["f32", "float"]])),
                    }
                }
                other => panic!("fixture attribute {other:?}"),
            };
            attrs[k].1 = new.clone();
            (format!("attribute {name} = {new:?}"), expect)
        }
        AttrNullEntry => {
            let k = below(rng, attrs.len());
            let name = attrs[k].0.clone();
            let n2 = name.clone();
            tweak = Some(Box::new(move |f: &mut Frame| {
                let i = attr_index(f, &n2);
                // SAFETY: i < size of the frame's value array.
                unsafe { *f.raw.attrs.attrs.add(i) = std::ptr::null_mut() };
            }));
            (format!("attribute {name} with a null value entry"), invalid_named(&name, &[&["no value", "no data"]]))
        }
        AttrNullName => {
            let k = below(rng, attrs.len());
            let name = attrs[k].0.clone();
            let n2 = name.clone();
            tweak = Some(Box::new(move |f: &mut Frame| {
                let i = attr_index(f, &n2);
                // SAFETY: i < size of the frame's name array.
                unsafe { *f.raw.attrs.names.add(i) = std::ptr::null_mut() };
            }));
            (format!("attribute {name} with a null name"), renamed_expect(s, &name, ""))
        }
        AttrTypeCode => {
            let k = below(rng, attrs.len());
            let name = attrs[k].0.clone();
            let code = *pick(rng, &[ATTR_ARRAY, ATTR_DICTIONARY, 0, 99, -1]);
            let n2 = name.clone();
            tweak = Some(Box::new(move |f: &mut Frame| {
                let i = attr_index(f, &n2);
                // SAFETY: i < size of the frame's type array.
                unsafe { *f.raw.attrs.types.add(i) = code };
            }));
            (format!("attribute {name} of attribute type {code}"), invalid_named(&name, &[&["expected"]]))
        }
        AttrNullValue => {
            let k = below(rng, attrs.len());
            let name = attrs[k].0.clone();
            let string = matches!(attrs[k].1, Attr::Str(_));
            let n2 = name.clone();
            tweak = Some(Box::new(move |f: &mut Frame| {
                let i = attr_index(f, &n2);
                // SAFETY: the entry is the frame's own Scalar or ByteSpan, as its type says.
                unsafe {
                    let entry = *f.raw.attrs.attrs.add(i);
                    if string {
                        (*(entry as *mut ByteSpan)).ptr = std::ptr::null();
                    } else {
                        (*(entry as *mut Scalar)).value = std::ptr::null_mut();
                    }
                }
            }));
            let words: &[&str] = if string { &["no data"] } else { &["no value"] };
            (format!("attribute {name} with null data"), invalid_named(&name, &[words]))
        }
        AttrBoolFlip => {
            let bools: Vec<usize> = (0..attrs.len()).filter(|&k| matches!(attrs[k].1, Attr::Bool(_))).collect();
            let k = *pick(rng, &bools);
            let Attr::Bool(b) = attrs[k].1 else { unreachable!() };
            attrs[k].1 = Attr::Bool(!b);
            let name = attrs[k].0.clone();
            let expect = match name.as_str() {
                "delta_softplus" | "dt_softplus" | "silu" => Expect::Ok,
                // true -> false with no workspace: chunk_states then reads as the workspace.
                "save_chunk_states" if b && s.result("workspace").is_none() => Expect::Ok,
                "save_chunk_states" => invalid(&[&["results", "chunk_states", "shape", "dtype"]]),
                _ => invalid(&[&["operands", "results"]]),
            };
            (format!("attribute {name} = {}", !b), expect)
        }
        AttrBoolOdd => {
            let bools: Vec<usize> = (0..attrs.len()).filter(|&k| matches!(attrs[k].1, Attr::Bool(true))).collect();
            let k = *pick(rng, bools.first().map(|_| &bools[..])?);
            let v = 2 + below(rng, 254) as u8;
            attrs[k].1 = Attr::Scalar(PRED, vec![v]);
            (format!("attribute {} = pred {v}", attrs[k].0), Expect::Ok)
        }
        AttrIntValue => {
            let (name, orig) = match s.op {
                Op::ScanFwd | Op::ScanBwd => ("checkpoint_len", s.attr_i64("checkpoint_len").unwrap_or(0)),
                Op::SsdFwd | Op::SsdBwd | Op::SsdRecords => ("chunk_size", s.attr_i64("chunk_size").unwrap()),
                Op::CarryFwd | Op::CarryBwd => ("segment_len", s.attr_i64("segment_len").unwrap()),
                _ => return None,
            };
            let v = *pick(
                rng,
                &[0, -1, -32, 1, 31, 33, 48, 32, 64, 96, 128, 256, 512, 1 << 40, i64::MAX, i64::MIN, i64::MAX & !31],
            );
            if v == orig {
                return None;
            }
            let expect = if name == "checkpoint_len" {
                checkpoint_len_expect(s, v)
            } else if name == "segment_len" {
                segment_len_expect(s, orig, v)
            } else if ![32, 64, 128, 256].contains(&v) || (s.op == Op::SsdRecords && v == 32) {
                // The part records take only the tensor-core kernels' chunks (whole 64-step tiles).
                invalid_named("chunk_size", &[])
            } else if s.op == Op::SsdFwd && s.operand("part_records").is_some() && v == 32 {
                invalid_named("part_records", &[]) // a shape with no part records: the operand must be empty
            } else if matches!(s.op, Op::SsdFwd | Op::SsdRecords) && s.result("chunk_states").is_none() {
                Expect::Ok
            } else {
                either(&[&["chunk_states"]])
            };
            match attrs.iter_mut().find(|(n, _)| n == name) {
                Some(a) => a.1 = scalar_i64(S64, v),
                None => attrs.push((name.into(), scalar_i64(S64, v))),
            }
            (format!("attribute {name} = {v}"), expect)
        }
        AttrFloatValue => {
            if !s.op.is_ssd() {
                return None;
            }
            let (mut lo, mut hi) = (s.attr_f32("dt_min"), s.attr_f32("dt_max"));
            let v = *pick(rng, &ODD_FLOATS);
            let name = if below(rng, 2) == 0 { "dt_min" } else { "dt_max" };
            if name == "dt_min" {
                lo = v
            } else {
                hi = v
            }
            attrs.iter_mut().find(|(n, _)| n == name).unwrap().1 = Attr::Scalar(F32, v.to_le_bytes().to_vec());
            let expect = if dt_limits_ok(lo, hi) { Expect::Ok } else { invalid_named("dt_min", &[]) };
            (format!("dt_min = {lo}, dt_max = {hi}"), expect)
        }
        AttrStrValue => {
            let k = attrs.iter().position(|(n, _)| n == "layout")?;
            let v = *pick(rng, &["", "BDL", "lbd", "bdl ", "b", "bld\0", "bdl", "bld", "\u{e9}"]);
            let Attr::Str(ref orig) = attrs[k].1 else { unreachable!() };
            if v == orig {
                return None;
            }
            let expect = if v == "bdl" || v == "bld" { either(&[SHAPE]) } else { invalid_named("layout", &[]) };
            attrs[k].1 = Attr::Str(v.into());
            (format!("layout = {v:?}"), expect)
        }
        StreamFails => {
            tweak = Some(Box::new(|f: &mut Frame| f.ctx.fail_stream_get = true));
            ("XLA_FFI_Stream_Get fails".into(), Expect::HostError("no stream for you"))
        }
        MetadataOk => {
            metadata = Some((xla::METADATA_EXTENSION_STRUCT_SIZE, false, xla::METADATA_STRUCT_SIZE_V1));
            ("metadata request".into(), Expect::Nothing)
        }
        MetadataBad => {
            let m = match below(rng, 3) {
                0 => (*pick(rng, &[0usize, 8, 24, 31]), false, xla::METADATA_STRUCT_SIZE),
                1 => (xla::METADATA_EXTENSION_STRUCT_SIZE, true, xla::METADATA_STRUCT_SIZE),
                _ => (xla::METADATA_EXTENSION_STRUCT_SIZE, false, *pick(rng, &[0usize, 8, 24, 35])),
            };
            metadata = Some(m);
            (format!("metadata request {m:?}"), invalid(&[&["XLA_FFI_Metadata"]]))
        }
        BoundaryValues => {
            let i = s.operand("cu_seqlens")?;
            let (values, expect) = boundary_values(rng, &s.cu_seqlens()?, call_seqlen(&s.call));
            args[i].data = values.as_ptr() as *mut c_void;
            let what = format!("cu_seqlens = {values:?}");
            keep = Some(values);
            (what, expect)
        }
    };
    Some(XCase { args, rets, attrs, tweak, metadata, _keep: keep, expect, what })
}

/// Other values of a packed call's boundaries `cu` (same count): valid ones at times, else a first
/// boundary other than 0, a decrease, or a last one other than seqlen. The expectation is what the
/// host's check (first, then order, then last) says of them.
fn boundary_values(rng: &mut Rng, cu: &[i32], seqlen: i64) -> (Vec<i32>, Expect) {
    let mut v = cu.to_vec();
    let n = v.len() - 1; // num_seqs
    let l = seqlen as i32;
    match below(rng, 5) {
        0 => v = random_cu_seqlens(rng, n, seqlen as usize),
        1 => v[0] = *pick(rng, &[1, -1, l, i32::MIN, i32::MAX]),
        2 if n >= 1 => {
            let j = 1 + below(rng, n);
            v[j] = v[j - 1] - 1 - below(rng, 3) as i32;
        }
        3 if n >= 2 => v[1 + below(rng, n - 1)] = *pick(rng, &[l + 1, i32::MAX]), // above what follows
        _ => v[n] = *pick(rng, &[l - 1, l + 1, l + 1000, i32::MAX]),
    }
    let problem = if v[0] != 0 {
        Some("first boundary")
    } else if v.windows(2).any(|w| w[1] < w[0]) {
        Some("not decrease")
    } else if i64::from(v[n]) != seqlen {
        Some("last boundary")
    } else {
        None
    };
    let expect = match problem {
        None => Expect::Ok,
        Some(word) => Expect::HostValues(vec![named("cu_seqlens"), words(&[word])]),
    };
    (v, expect)
}

/// A metadata request as XLA makes it, malformed as asked; the frame carries an API table so that
/// an error can be returned. Returns the outcome and the traits written.
fn call_metadata(handler: Handler, (ext_size, null_metadata, meta_size): (usize, bool, usize)) -> (Outcome, u32) {
    let api = xla::api();
    let mut metadata = xla::Metadata {
        struct_size: meta_size,
        api_version: xla::ApiVersion {
            struct_size: xla::API_VERSION_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            major_version: -1,
            minor_version: -1,
        },
        traits: 0xdead,
        state_type_id: -7,
    };
    let mut ext = xla::MetadataExtension {
        extension_base: xla::ExtensionBase { struct_size: ext_size, type_: 1, next: std::ptr::null_mut() },
        metadata: if null_metadata { std::ptr::null_mut() } else { &mut metadata },
    };
    // SAFETY: all-zero is a valid CallFrame (null pointers, zero sizes).
    let mut frame: xla::CallFrame = unsafe { std::mem::zeroed() };
    frame.struct_size = xla::CALL_FRAME_STRUCT_SIZE;
    frame.extension_start = &mut ext.extension_base;
    frame.api = &api;
    // SAFETY: a frame as XLA builds it for the handshake, owning everything it points at.
    let result = unsafe {
        let err = handler(&mut frame as *mut xla::CallFrame as *mut xla_ssm::xla::ffi::XLA_FFI_CallFrame);
        xla::take_error(&api, err as *mut c_void)
    };
    let outcome = match result {
        Ok(()) => Outcome::Ok,
        Err((code, msg)) => Outcome::Err(xla_code(code), msg),
    };
    if matches!(outcome, Outcome::Ok) && metadata.state_type_id != -7 {
        return (Outcome::Err(Code::Other(-1), "wrote past the API 0.1 metadata struct".into()), metadata.traits);
    }
    (outcome, metadata.traits)
}

fn xla_code(code: i32) -> Code {
    match code {
        xla::ERR_INVALID_ARGUMENT => Code::Invalid,
        xla::ERR_UNIMPLEMENTED => Code::Unimplemented,
        xla::ERR_INTERNAL => Code::Internal,
        other => Code::Other(other),
    }
}

/// The byte ranges a frame's results describe (what a successful call may write).
fn result_regions(rets: &[Buf]) -> Vec<(usize, usize)> {
    rets.iter()
        .filter(|b| !b.data.is_null())
        .map(|b| {
            let n = b.dims.iter().try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?));
            let bytes = n.map_or(usize::MAX, |n| n.saturating_mul(elem_size(b.dtype).max(1)));
            (b.data as usize, bytes)
        })
        .collect()
}

#[test]
fn xla_handlers_refuse_bad_frames() {
    let set = settings();
    let cases = set.cases * 13 / 20;
    let calls = fixture_calls();
    let mut setups: Vec<Setup> = calls.into_iter().enumerate().map(|(k, c)| Setup::new(c, 77 + k as u64)).collect();
    for t in xla_ssm::xla::register::TARGETS {
        assert!(setups.iter().any(|s| s.call.target == t.name), "no fixture call for target {}", t.name);
    }
    let cuda_ok = cuda_calls_allowed();
    if !cuda_ok {
        println!("a CUDA device is present: the CUDA handlers are left to tests/suite/ffi_cuda*.rs");
    }
    let start = Instant::now();
    let mut tally = Tally::default();
    for i in 0..cases {
        if set.only.is_some_and(|o| o != i) {
            continue;
        }
        let mut rng = case_rng(set.seed, 1, i);
        let kind = XKINDS[(i % XKINDS.len() as u64) as usize];
        // Every kind goes through the calls in turn; one that does not apply moves to the next.
        let first = (i / XKINDS.len() as u64) as usize;
        let mut found = None;
        for k in 0..setups.len() * 3 {
            let idx = (first + k) % setups.len();
            if let Some(case) = gen_xla(kind, &setups[idx], &mut rng) {
                found = Some((idx, case));
                break;
            }
        }
        let Some((idx, case)) = found else { continue };
        let s = &mut setups[idx];
        let cuda = cuda_ok && below(&mut rng, 4) == 0;
        let (cpu_handler, cuda_handler) = handlers(&s.call.target);
        let handler = if cuda { cuda_handler } else { cpu_handler };
        let label = format!("case {i} [{kind:?}] {} ({}): {}", s.call.id, if cuda { "cuda" } else { "cpu" }, case.what);
        if set.trace {
            eprintln!("{label}");
        }
        s.reset();
        let mut expect = case.expect.clone();
        if kind == XKind::StreamFails && !cuda {
            expect = Expect::Ok; // the CPU handlers never ask for a stream
        }
        let (outcome, allowed) = if let Some(m) = case.metadata {
            let (outcome, traits) = call_metadata(handler, m);
            if matches!(outcome, Outcome::Ok) && traits != cuda as u32 {
                tally.fail(format!("{label}: the handshake reported traits {traits}"));
            }
            (outcome, vec![])
        } else {
            let mut frame = {
                let refs: Vec<(&str, Attr)> = case.attrs.iter().map(|(n, a)| (n.as_str(), a.clone())).collect();
                Frame::new(&case.args, &case.rets, &refs, std::ptr::null_mut())
            };
            if let Some(t) = case.tweak {
                t(&mut frame);
            }
            let outcome = match xla::call(handler, &mut frame) {
                Ok(()) => Outcome::Ok,
                Err((code, msg)) => Outcome::Err(xla_code(code), msg),
            };
            (outcome, result_regions(&case.rets))
        };
        tally.record(&format!("{kind:?}"), &s.call.target, &outcome);
        match judge(&expect, cuda, &outcome) {
            Err(why) => tally.fail(format!("{label}: {why}, got {outcome:?}")),
            Ok(wrote) => {
                if let Err(why) = s.check_writes(if wrote { &allowed } else { &[] }) {
                    tally.fail(format!("{label}: {why} (outcome {outcome:?})"));
                }
            }
        }
    }
    if set.only.is_none() {
        for &kind in XKINDS {
            assert!(tally.by_kind.contains_key(&format!("{kind:?}")), "no case of {kind:?} ran");
        }
    }
    tally.finish("xla_handlers_refuse_bad_frames", start, &set);
}

// ---------------------------------------------------------------------------------------------
// The C API.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum K {
    /// An i64 size.
    Size,
    /// An i32 dtype code.
    Dtype,
    /// The i32 layout code.
    Layout,
    /// A bool.
    Flag,
    /// An f32.
    Float,
    /// A required input pointer.
    In,
    /// An optional input pointer.
    Opt,
    /// A required output pointer.
    Out,
    /// An optional output pointer.
    OptOut,
    /// A state, read and written in place.
    State,
    /// The workspace pointer.
    Ws,
    /// The workspace's size in bytes.
    WsBytes,
}

impl K {
    fn is_ptr(self) -> bool {
        matches!(self, K::In | K::Opt | K::Out | K::OptOut | K::State | K::Ws)
    }

    fn writes(self) -> bool {
        matches!(self, K::Out | K::OptOut | K::State | K::Ws)
    }
}

#[derive(Clone, Copy, Debug)]
struct CField {
    name: &'static str,
    off: usize,
    kind: K,
    /// The buffer (fixture and message name) a pointer field addresses.
    buf: &'static str,
}

struct CApi {
    op: Op,
    name: &'static str,
    size: usize,
    fields: Vec<CField>,
    host: fn(*const c_void) -> XlaSsmStatus,
    cuda: fn(*const c_void) -> XlaSsmStatus,
}

macro_rules! field {
    ($t:ty, $kind:ident, $buf:literal, $name:ident $(. $rest:ident)*) => {
        CField { name: last_name(stringify!($name $(. $rest)*)), off: offset_of!($t, $name $(. $rest)*), kind: K::$kind, buf: $buf }
    };
}

fn last_name(path: &'static str) -> &'static str {
    path.rsplit(['.', ' ']).next().unwrap()
}

fn scan_fwd_api() -> CApi {
    type T = XlaSsmSelectiveScanFwdArgs;
    CApi {
        op: Op::ScanFwd,
        name: "xla_ssm_selective_scan_fwd",
        size: size_of::<T>(),
        fields: vec![
            field!(T, Size, "", batch),
            field!(T, Size, "", dim),
            field!(T, Size, "", seqlen),
            field!(T, Size, "", dstate),
            field!(T, Size, "", groups),
            field!(T, Dtype, "", dtype),
            field!(T, Dtype, "", bc_dtype),
            field!(T, Layout, "", layout),
            field!(T, Flag, "", delta_softplus),
            field!(T, In, "u", u),
            field!(T, In, "delta", delta),
            field!(T, In, "A", a),
            field!(T, In, "B", b),
            field!(T, In, "C", c),
            field!(T, Opt, "D", d),
            field!(T, Opt, "z", z),
            field!(T, Opt, "delta_bias", delta_bias),
            field!(T, Opt, "initial_state", initial_state),
            field!(T, Out, "out", out),
            field!(T, Out, "final_state", final_state),
            field!(T, Ws, "workspace", workspace),
            field!(T, WsBytes, "", workspace_bytes),
            field!(T, Size, "", checkpoint_len),
            field!(T, OptOut, "checkpoints", checkpoints),
            field!(T, Opt, "cu_seqlens", cu_seqlens),
            field!(T, Size, "", num_seqs),
        ],
        // SAFETY (each entry point below): the pointer is NULL or addresses an argument struct of
        // its type whose pointers address arena slots of at least the sizes the cases describe.
        host: |p| unsafe { xla_ssm_selective_scan_fwd_host(p as *const T) },
        cuda: |p| unsafe { xla_ssm_selective_scan_fwd_cuda_launch(p as *const T, std::ptr::null_mut()) },
    }
}

fn scan_bwd_api() -> CApi {
    type T = XlaSsmSelectiveScanBwdArgs;
    CApi {
        op: Op::ScanBwd,
        name: "xla_ssm_selective_scan_bwd",
        size: size_of::<T>(),
        fields: vec![
            field!(T, Size, "", batch),
            field!(T, Size, "", dim),
            field!(T, Size, "", seqlen),
            field!(T, Size, "", dstate),
            field!(T, Size, "", groups),
            field!(T, Dtype, "", dtype),
            field!(T, Dtype, "", bc_dtype),
            field!(T, Layout, "", layout),
            field!(T, Flag, "", delta_softplus),
            field!(T, In, "u", u),
            field!(T, In, "delta", delta),
            field!(T, In, "A", a),
            field!(T, In, "B", b),
            field!(T, In, "C", c),
            field!(T, Opt, "D", d),
            field!(T, Opt, "z", z),
            field!(T, Opt, "delta_bias", delta_bias),
            field!(T, Opt, "initial_state", initial_state),
            field!(T, Size, "", checkpoint_len),
            field!(T, In, "checkpoints", checkpoints),
            field!(T, In, "dout", dout),
            field!(T, Opt, "dfinal_state", dfinal_state),
            field!(T, Out, "du", du),
            field!(T, Out, "ddelta", ddelta),
            field!(T, Out, "dA", da),
            field!(T, Out, "dB", db),
            field!(T, Out, "dC", dc),
            field!(T, OptOut, "dD", dd),
            field!(T, OptOut, "dz", dz),
            field!(T, OptOut, "ddelta_bias", ddelta_bias),
            field!(T, OptOut, "dinitial_state", dinitial_state),
            field!(T, Ws, "workspace", workspace),
            field!(T, WsBytes, "", workspace_bytes),
            field!(T, Opt, "cu_seqlens", cu_seqlens),
            field!(T, Size, "", num_seqs),
        ],
        // SAFETY (both): as for `scan_fwd_api`'s entry points.
        host: |p| unsafe { xla_ssm_selective_scan_bwd_host(p as *const T) },
        cuda: |p| unsafe { xla_ssm_selective_scan_bwd_cuda_launch(p as *const T, std::ptr::null_mut()) },
    }
}

fn ssd_fwd_api() -> CApi {
    type T = XlaSsmSsdFwdArgs;
    CApi {
        op: Op::SsdFwd,
        name: "xla_ssm_ssd_fwd",
        size: size_of::<T>(),
        fields: vec![
            field!(T, Size, "", batch),
            field!(T, Size, "", seqlen),
            field!(T, Size, "", heads),
            field!(T, Size, "", headdim),
            field!(T, Size, "", dstate),
            field!(T, Size, "", groups),
            field!(T, Size, "", chunk_size),
            field!(T, Dtype, "", dtype),
            field!(T, Flag, "", d_per_channel),
            field!(T, Flag, "", dt_softplus),
            field!(T, Float, "", dt_min),
            field!(T, Float, "", dt_max),
            field!(T, In, "x", x),
            field!(T, In, "dt", dt),
            field!(T, In, "A", a),
            field!(T, In, "B", b),
            field!(T, In, "C", c),
            field!(T, Opt, "D", d),
            field!(T, Opt, "z", z),
            field!(T, Opt, "dt_bias", dt_bias),
            field!(T, Opt, "initial_states", initial_states),
            field!(T, Out, "y", y),
            field!(T, Out, "final_states", final_states),
            field!(T, OptOut, "chunk_states", chunk_states),
            field!(T, Dtype, "", chunk_states_dtype),
            field!(T, Ws, "workspace", workspace),
            field!(T, WsBytes, "", workspace_bytes),
        ],
        // SAFETY (both): as for `scan_fwd_api`'s entry points.
        host: |p| unsafe { xla_ssm_ssd_fwd_host(p as *const T) },
        cuda: |p| unsafe { xla_ssm_ssd_fwd_cuda_launch(p as *const T, std::ptr::null_mut()) },
    }
}

fn ssd_bwd_api() -> CApi {
    type T = XlaSsmSsdBwdArgs;
    CApi {
        op: Op::SsdBwd,
        name: "xla_ssm_ssd_bwd",
        size: size_of::<T>(),
        fields: vec![
            field!(T, Size, "", batch),
            field!(T, Size, "", seqlen),
            field!(T, Size, "", heads),
            field!(T, Size, "", headdim),
            field!(T, Size, "", dstate),
            field!(T, Size, "", groups),
            field!(T, Size, "", chunk_size),
            field!(T, Dtype, "", dtype),
            field!(T, Flag, "", d_per_channel),
            field!(T, Flag, "", dt_softplus),
            field!(T, Float, "", dt_min),
            field!(T, Float, "", dt_max),
            field!(T, In, "x", x),
            field!(T, In, "dt", dt),
            field!(T, In, "A", a),
            field!(T, In, "B", b),
            field!(T, In, "C", c),
            field!(T, Opt, "D", d),
            field!(T, Opt, "z", z),
            field!(T, Opt, "dt_bias", dt_bias),
            field!(T, Opt, "initial_states", initial_states),
            field!(T, In, "chunk_states", chunk_states),
            field!(T, Dtype, "", chunk_states_dtype),
            field!(T, In, "dy", dy),
            field!(T, Opt, "dfinal_states", dfinal_states),
            field!(T, Out, "dx", dx),
            field!(T, Out, "ddt", ddt),
            field!(T, Out, "dA", da),
            field!(T, Out, "dB", db),
            field!(T, Out, "dC", dc),
            field!(T, OptOut, "dD", dd),
            field!(T, OptOut, "dz", dz),
            field!(T, OptOut, "ddt_bias", ddt_bias),
            field!(T, OptOut, "dinitial_states", dinitial_states),
            field!(T, Ws, "workspace", workspace),
            field!(T, WsBytes, "", workspace_bytes),
        ],
        // SAFETY (both): as for `scan_fwd_api`'s entry points.
        host: |p| unsafe { xla_ssm_ssd_bwd_host(p as *const T) },
        cuda: |p| unsafe { xla_ssm_ssd_bwd_cuda_launch(p as *const T, std::ptr::null_mut()) },
    }
}

fn state_update_api() -> CApi {
    type T = XlaSsmStateUpdateArgs;
    CApi {
        op: Op::StateUpdate,
        name: "xla_ssm_selective_state_update",
        size: size_of::<T>(),
        fields: vec![
            field!(T, Size, "", batch),
            field!(T, Size, "", dim),
            field!(T, Size, "", dstate),
            field!(T, Size, "", groups),
            field!(T, Size, "", n_slots),
            field!(T, Dtype, "", dtype),
            field!(T, Dtype, "", bc_dtype),
            field!(T, Dtype, "", state_dtype),
            field!(T, Flag, "", dt_softplus),
            field!(T, State, "state", state),
            field!(T, In, "x", x),
            field!(T, In, "dt", dt),
            field!(T, In, "A", a),
            field!(T, In, "B", b),
            field!(T, In, "C", c),
            field!(T, Opt, "D", d),
            field!(T, Opt, "z", z),
            field!(T, Opt, "dt_bias", dt_bias),
            field!(T, Opt, "state_batch_indices", state_batch_indices),
            field!(T, Out, "out", out),
        ],
        // SAFETY (both): as for `scan_fwd_api`'s entry points.
        host: |p| unsafe { xla_ssm_selective_state_update_host(p as *const T) },
        cuda: |p| unsafe { xla_ssm_selective_state_update_cuda_launch(p as *const T, std::ptr::null_mut()) },
    }
}

fn decode_api() -> CApi {
    type T = XlaSsmDecodeStepArgs;
    CApi {
        op: Op::Decode,
        name: "xla_ssm_mamba_decode_step",
        size: size_of::<T>(),
        fields: vec![
            field!(T, Size, "", ssm.batch),
            field!(T, Size, "", ssm.dim),
            field!(T, Size, "", ssm.dstate),
            field!(T, Size, "", ssm.groups),
            field!(T, Size, "", ssm.n_slots),
            field!(T, Dtype, "", ssm.dtype),
            field!(T, Dtype, "", ssm.bc_dtype),
            field!(T, Dtype, "", ssm.state_dtype),
            field!(T, Flag, "", ssm.dt_softplus),
            field!(T, State, "ssm_state", ssm.state),
            field!(T, In, "x", ssm.x),
            field!(T, In, "dt", ssm.dt),
            field!(T, In, "A", ssm.a),
            field!(T, In, "B", ssm.b),
            field!(T, In, "C", ssm.c),
            field!(T, Opt, "D", ssm.d),
            field!(T, Opt, "z", ssm.z),
            field!(T, Opt, "dt_bias", ssm.dt_bias),
            field!(T, Opt, "state_batch_indices", ssm.state_batch_indices),
            field!(T, Out, "out", ssm.out),
            field!(T, Size, "", width),
            field!(T, Dtype, "", conv_dtype),
            field!(T, State, "conv_state", conv_state),
            field!(T, In, "conv_weight", conv_weight),
            field!(T, Opt, "conv_bias", conv_bias),
        ],
        // SAFETY (both): as for `scan_fwd_api`'s entry points.
        host: |p| unsafe { xla_ssm_mamba_decode_step_host(p as *const T) },
        cuda: |p| unsafe { xla_ssm_mamba_decode_step_cuda_launch(p as *const T, std::ptr::null_mut()) },
    }
}

fn c_api_of(op: Op) -> Option<CApi> {
    match op {
        Op::ScanFwd => Some(scan_fwd_api()),
        Op::ScanBwd => Some(scan_bwd_api()),
        Op::SsdFwd => Some(ssd_fwd_api()),
        Op::SsdBwd => Some(ssd_bwd_api()),
        Op::StateUpdate => Some(state_update_api()),
        Op::Decode => Some(decode_api()),
        _ => None,
    }
}

/// An argument struct as bytes (8-byte aligned), written and read field by field.
#[derive(Clone)]
struct CArgs {
    words: Vec<u64>,
}

impl CArgs {
    fn new(size: usize) -> CArgs {
        CArgs { words: vec![0; size.div_ceil(8)] }
    }

    fn at(&mut self, f: &CField) -> *mut u8 {
        (self.words.as_mut_ptr() as *mut u8).wrapping_add(f.off)
    }

    // SAFETY (the accessors): `f` is a field of the struct these words hold, at its offset and of
    // the type its kind says; bools are written as 0 or 1 only.
    fn set_i64(&mut self, f: &CField, v: i64) {
        unsafe { (self.at(f) as *mut i64).write_unaligned(v) }
    }

    fn i64(&mut self, f: &CField) -> i64 {
        unsafe { (self.at(f) as *const i64).read_unaligned() }
    }

    fn set_i32(&mut self, f: &CField, v: i32) {
        unsafe { (self.at(f) as *mut i32).write_unaligned(v) }
    }

    fn i32(&mut self, f: &CField) -> i32 {
        unsafe { (self.at(f) as *const i32).read_unaligned() }
    }

    fn set_bool(&mut self, f: &CField, v: bool) {
        unsafe { *self.at(f) = v as u8 }
    }

    fn bool(&mut self, f: &CField) -> bool {
        unsafe { *self.at(f) != 0 }
    }

    fn set_f32(&mut self, f: &CField, v: f32) {
        unsafe { (self.at(f) as *mut f32).write_unaligned(v) }
    }

    fn f32(&mut self, f: &CField) -> f32 {
        unsafe { (self.at(f) as *const f32).read_unaligned() }
    }

    fn set_ptr(&mut self, f: &CField, v: usize) {
        unsafe { (self.at(f) as *mut usize).write_unaligned(v) }
    }

    fn ptr(&mut self, f: &CField) -> usize {
        unsafe { (self.at(f) as *const usize).read_unaligned() }
    }

    fn as_ptr(&self) -> *const c_void {
        self.words.as_ptr() as *const c_void
    }
}

fn field<'a>(api: &'a CApi, name: &str) -> &'a CField {
    api.fields.iter().find(|f| f.name == name).unwrap_or_else(|| panic!("{}: no field {name}", api.name))
}

/// The argument struct of a fixture call, its pointers in the arena.
fn c_base(s: &Setup, api: &CApi) -> CArgs {
    let mut a = CArgs::new(api.size);
    let ws_bytes = s.result("workspace").map_or(0, |i| s.call.results[i].bytes() as i64);
    let mut values: Vec<(&str, i64)> = vec![];
    if api.fields.iter().any(|f| f.name == "workspace_bytes") {
        values.push(("workspace_bytes", ws_bytes));
    }
    let mut codes: Vec<(&str, i32)> = vec![];
    let mut flags: Vec<(&str, bool)> = vec![];
    match s.op {
        Op::ScanFwd | Op::ScanBwd => {
            let u = &s.operand_entry("u").dims;
            let (batch, dim, seqlen) = if s.bld() { (u[0], u[2], u[1]) } else { (u[0], u[1], u[2]) };
            let b = &s.operand_entry("B").dims;
            let groups = match b.len() {
                4 if s.bld() => b[2],
                4 => b[1],
                _ => 0,
            };
            let dstate = s.operand_entry("A").dims[1];
            let len = s.attr_i64("checkpoint_len").unwrap_or(0);
            let num_seqs = s.operand("cu_seqlens").map_or(0, |i| s.call.operands[i].dims[0] - 1);
            values.extend([
                ("batch", batch),
                ("dim", dim),
                ("seqlen", seqlen),
                ("dstate", dstate),
                ("groups", groups),
                ("checkpoint_len", len),
                ("num_seqs", num_seqs),
            ]);
            codes.extend([
                ("dtype", capi_dtype(s.operand_entry("u").dtype)),
                ("bc_dtype", capi_dtype(s.operand_entry("B").dtype)),
                ("layout", if s.bld() { XLA_SSM_LAYOUT_BLD } else { XLA_SSM_LAYOUT_BDL }),
            ]);
            flags.push(("delta_softplus", s.attr_bool("delta_softplus")));
        }
        Op::SsdFwd | Op::SsdBwd => {
            let x = &s.operand_entry("x").dims;
            let b = &s.operand_entry("B").dims;
            let chunk_size = s.attr_i64("chunk_size").unwrap();
            values.extend([
                ("batch", x[0]),
                ("seqlen", x[1]),
                ("heads", x[2]),
                ("headdim", x[3]),
                ("dstate", b[3]),
                ("groups", b[2]),
                ("chunk_size", chunk_size),
            ]);
            let dtype = capi_dtype(s.operand_entry("x").dtype);
            let cs = s.named_slot("chunk_states").map(|_| {
                let e = match s.operand("chunk_states") {
                    Some(i) => &s.call.operands[i],
                    None => &s.call.results[s.result("chunk_states").unwrap()],
                };
                capi_dtype(e.dtype)
            });
            codes.extend([("dtype", dtype), ("chunk_states_dtype", cs.unwrap_or(XLA_SSM_F32))]);
            let d_per_channel = s.operand("D").is_some_and(|i| s.call.operands[i].dims.len() == 2);
            flags.extend([("d_per_channel", d_per_channel), ("dt_softplus", s.attr_bool("dt_softplus"))]);
            a.set_f32(field(api, "dt_min"), s.attr_f32("dt_min"));
            a.set_f32(field(api, "dt_max"), s.attr_f32("dt_max"));
        }
        Op::StateUpdate | Op::Decode => {
            let state = if s.op == Op::Decode { "ssm_state" } else { "state" };
            let x = &s.operand_entry("x").dims;
            values.extend([
                ("batch", x[0]),
                ("dim", x[1]),
                ("dstate", s.operand_entry("A").dims[1]),
                ("groups", s.operand_entry("B").dims[1]),
                ("n_slots", s.operand_entry(state).dims[0]),
            ]);
            codes.extend([
                ("dtype", capi_dtype(s.operand_entry("x").dtype)),
                ("bc_dtype", capi_dtype(s.operand_entry("B").dtype)),
                ("state_dtype", capi_dtype(s.operand_entry(state).dtype)),
            ]);
            flags.push(("dt_softplus", s.attr_bool("dt_softplus")));
            if s.op == Op::Decode {
                let w = s.operand_entry("conv_weight");
                values.push(("width", w.dims[1]));
                codes.push(("conv_dtype", capi_dtype(w.dtype)));
            }
        }
        _ => unreachable!(),
    }
    for (name, v) in values {
        a.set_i64(field(api, name), v);
    }
    for (name, v) in codes {
        a.set_i32(field(api, name), v);
    }
    for (name, v) in flags {
        a.set_bool(field(api, name), v);
    }
    for f in api.fields.iter().filter(|f| f.kind.is_ptr()) {
        if let Some((_, p)) = s.named_slot(f.buf) {
            a.set_ptr(f, p as usize);
        }
    }
    a
}

/// The slot of a pointer field's buffer (its bytes, its capacity).
fn field_slot(s: &Setup, f: &CField) -> Option<Slot> {
    s.named_slot(f.buf).map(|(slot, _)| slot)
}

kinds!(
    CKind, CKINDS:
    Baseline, NullArgs, BadDtypeCode, OtherDtype, BadLayout, LayoutFlip, NegativeSize, HugeSize,
    ZeroSize, SmallerSize, OddSize, NullPointer, MisalignedPointer, OverlappingPointer,
    SharedInputs, FlagFlip, DtLimits, BoundaryValues,
);

/// How much of its slot a successful call may write: the buffer as given, or all of its slot (for
/// mutations that describe a larger element type over it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Region {
    Exact,
    Slot,
}

struct CCase {
    /// None: a NULL argument pointer.
    args: Option<CArgs>,
    /// Host memory a pointer was set to (outside the arena), kept alive through the call.
    _keep: Option<Vec<i32>>,
    expect: Expect,
    region: Region,
    what: String,
}

fn pick_field<'a>(api: &'a CApi, rng: &mut Rng, keep: impl Fn(&CField) -> bool) -> Option<&'a CField> {
    let fields: Vec<&CField> = api.fields.iter().filter(|f| keep(f)).collect();
    (!fields.is_empty()).then(|| *pick(rng, &fields))
}

/// The product of the sizes `groups` must divide.
fn groups_total(api: &CApi, a: &mut CArgs) -> i64 {
    let name = if api.op.is_ssd() { "heads" } else { "dim" };
    a.i64(field(api, name))
}

/// What a size field set to `v` (from `orig`) makes of the call. Only values that describe no
/// buffer larger than the fixture's are generated valid (checkpoint_len and chunk_size larger, the
/// rest smaller), or ones too large to be valid.
fn c_size_expect(s: &Setup, api: &CApi, a: &mut CArgs, f: &CField, orig: i64, v: i64) -> (Expect, Region) {
    let shape = || invalid(&[SHAPE]);
    let either_shape = || either(&[SHAPE]);
    let ssd = api.op.is_ssd();
    let packed = api.fields.iter().any(|f| f.name == "cu_seqlens") && a.ptr(field(api, "cu_seqlens")) != 0;
    match f.name {
        "num_seqs" if !packed => (Expect::Ok, Region::Exact), // read only with cu_seqlens
        "num_seqs" if v < 0 || v > orig => (shape(), Region::Exact), // larger ones only past 2^48
        "num_seqs" => {
            // Fewer sequences: the first v + 1 boundaries, valid where the rest are empty ones.
            let cu = s.cu_seqlens().expect("a packed call");
            let e = if i64::from(cu[v as usize]) == a.i64(field(api, "seqlen")) {
                Expect::Ok
            } else {
                Expect::HostValues(vec![named("cu_seqlens"), words(&["last boundary"])])
            };
            (e, Region::Exact)
        }
        "batch" if packed && (0..orig).contains(&v) => (invalid_named("cu_seqlens", &[&["batch"]]), Region::Exact),
        "seqlen" if packed && (0..orig).contains(&v) => {
            // The boundaries still end at the old seqlen.
            (Expect::HostValues(vec![named("cu_seqlens"), words(&["last boundary"])]), Region::Exact)
        }
        "workspace_bytes" => (either(&[&["overlap", "workspace"]]), Region::Exact),
        "n_slots" => {
            let indices = a.ptr(field(api, "state_batch_indices"));
            if indices == 0 {
                (Expect::Ok, Region::Exact) // the state has batch rows then
            } else if v < 0 {
                (shape(), Region::Exact)
            } else {
                (either(&[&["shape", "slots", "state_batch_indices", "2^48"]]), Region::Exact)
            }
        }
        "checkpoint_len" => {
            let fwd = api.op == Op::ScanFwd;
            let has = a.ptr(field(api, "checkpoints")) != 0;
            let e = if v < 0 || v % 32 != 0 || (!fwd && v == 0) {
                invalid_named("checkpoint_len", &[])
            } else if fwd && v == 0 {
                if has {
                    invalid(&[&["checkpoint"]])
                } else {
                    Expect::Ok
                }
            } else if fwd && !has {
                invalid(&[&["checkpoints"], &["missing"]])
            } else {
                assert!(v >= orig, "a valid checkpoint_len below the fixture's describes more checkpoints");
                Expect::Ok
            };
            (e, Region::Exact)
        }
        "chunk_size" => {
            if ![32, 64, 128, 256].contains(&v) {
                (invalid_named("chunk_size", &[]), Region::Exact)
            } else {
                assert!(v >= orig, "a valid chunk_size below the fixture's describes more chunk states");
                (either(&[&["chunk_states"], &["dtype"]]), Region::Slot)
            }
        }
        "width" => {
            if !(2..=4).contains(&v) {
                (invalid(&[&["width"]]), Region::Exact)
            } else {
                (either_shape(), Region::Exact)
            }
        }
        "dstate" => {
            if v < 0 {
                (shape(), Region::Exact)
            } else if v > 256 || (ssd && v == 0) {
                (invalid(&[&["dstate"]]), Region::Exact)
            } else {
                (either_shape(), Region::Exact)
            }
        }
        "groups" => {
            let total = groups_total(api, a);
            if v < 0 {
                (shape(), Region::Exact)
            } else if v == 0 {
                let e = if api.op == Op::ScanFwd || api.op == Op::ScanBwd {
                    either_shape() // time-invariant B and C
                } else {
                    invalid(&[&["groups"]])
                };
                (e, Region::Slot)
            } else if total % v != 0 {
                (invalid(&[&["groups"]]), Region::Exact)
            } else {
                assert!(v <= orig || orig == 0, "more groups than the fixture's describe larger B and C");
                (either_shape(), Region::Exact)
            }
        }
        _ => {
            if v < 0 || v > orig {
                (shape(), Region::Exact) // larger ones are generated past 2^48 elements only
            } else {
                (either_shape(), Region::Exact)
            }
        }
    }
}

fn gen_c(kind: CKind, s: &Setup, api: &CApi, rng: &mut Rng) -> Option<CCase> {
    use CKind::*;
    let mut a = c_base(s, api);
    let mut region = Region::Exact;
    let mut keep = None;
    let (what, expect): (String, Expect) = match kind {
        Baseline => ("unchanged".into(), Expect::Ok),
        NullArgs => {
            let expect = invalid(&[&["args is NULL"]]);
            return Some(CCase { args: None, _keep: None, expect, region, what: "NULL".into() });
        }
        BadDtypeCode => {
            let f = pick_field(api, rng, |f| f.kind == K::Dtype)?;
            let code = *pick(rng, &[-1, 3, 4, 99, i32::MIN, i32::MAX]);
            a.set_i32(f, code);
            let unused = f.name == "chunk_states_dtype" && a.ptr(field(api, "chunk_states")) == 0;
            let e = if unused { Expect::Ok } else { invalid_named(f.name, &[&["dtype"]]) };
            (format!("{} = {code}", f.name), e)
        }
        OtherDtype => {
            let f = pick_field(api, rng, |f| f.kind == K::Dtype)?;
            let orig = a.i32(f);
            let code = *pick(rng, &[XLA_SSM_F32, XLA_SSM_BF16, XLA_SSM_F16]);
            if code == orig {
                return None;
            }
            a.set_i32(f, code);
            region = Region::Slot;
            let e = if f.name == "chunk_states_dtype" {
                if a.ptr(field(api, "chunk_states")) == 0 {
                    Expect::Ok
                } else {
                    invalid_named("chunk_states", &[&["dtype"]])
                }
            } else {
                either(&[&["dtype", "chunk_states"]])
            };
            (format!("{} = {code}", f.name), e)
        }
        BadLayout => {
            let f = pick_field(api, rng, |f| f.kind == K::Layout)?;
            let code = *pick(rng, &[-1, 2, 7, i32::MAX]);
            a.set_i32(f, code);
            (format!("layout = {code}"), invalid_named("layout", &[]))
        }
        LayoutFlip => {
            let f = pick_field(api, rng, |f| f.kind == K::Layout)?;
            let code = 1 - a.i32(f);
            a.set_i32(f, code);
            (format!("layout = {code}"), either(&[SHAPE]))
        }
        NegativeSize | HugeSize | ZeroSize | SmallerSize | OddSize => {
            let f = pick_field(api, rng, |f| matches!(f.kind, K::Size | K::WsBytes))?;
            let orig = a.i64(f);
            let v = match kind {
                NegativeSize => *pick(rng, &[-1, i64::MIN, -orig.max(1)]),
                HugeSize => match f.name {
                    "checkpoint_len" => *pick(rng, &[1i64 << 49, 1 << 62, i64::MAX, i64::MAX & !31]),
                    _ => *pick(rng, &[1i64 << 49, 1 << 62, i64::MAX]),
                },
                ZeroSize => 0,
                SmallerSize => match f.name {
                    "checkpoint_len" if orig > 0 => orig + 32 * (1 + below(rng, 4) as i64),
                    "chunk_size" => *pick(
                        rng,
                        &[64, 128, 256]
                            .into_iter()
                            .filter(|&c| c > orig)
                            .collect::<Vec<_>>()
                            .first()
                            .map(|_| [64i64, 128, 256].into_iter().filter(|&c| c > orig).collect::<Vec<_>>())?,
                    ),
                    "width" if orig > 2 => 2 + below(rng, (orig - 2) as usize) as i64,
                    "checkpoint_len" | "width" => return None,
                    "groups" if orig == 0 => return None,
                    _ if orig > 1 => 1 + below(rng, (orig - 1) as usize) as i64,
                    _ => return None,
                },
                _ => match f.name {
                    "dstate" => *pick(rng, &[257, 1000]),
                    "groups" => {
                        let total = groups_total(api, &mut a);
                        let bad: Vec<i64> = (1..=2 * total.max(1)).filter(|g| total % g != 0).collect();
                        *pick(rng, bad.first().map(|_| &bad[..])?)
                    }
                    "width" => *pick(rng, &[1, 5, 100]),
                    "chunk_size" => *pick(rng, &[16, 33, 48, 100, 512]),
                    "checkpoint_len" => *pick(rng, &[1, 31, 33, 48, orig + 1]),
                    "n_slots" => below(rng, orig.max(1) as usize) as i64,
                    _ => return None,
                },
            };
            if v == orig {
                return None;
            }
            a.set_i64(f, v);
            let (e, r) = c_size_expect(s, api, &mut a, f, orig, v);
            region = r;
            (format!("{} = {v}", f.name), e)
        }
        NullPointer => {
            let f = pick_field(api, rng, |f| f.kind.is_ptr())?;
            if a.ptr(f) == 0 {
                return None;
            }
            a.set_ptr(f, 0);
            let e = match f.kind {
                K::In | K::Out | K::State => invalid_named(f.buf, &[&["null"]]),
                K::Opt => either(&[&["missing", "given", "shape"]]),
                K::OptOut => either(&[&["missing"]]),
                _ => Expect::Ok,
            };
            (format!("{} = NULL", f.name), e)
        }
        MisalignedPointer => {
            let f = pick_field(api, rng, |f| f.kind.is_ptr() && f.kind != K::Ws && s.named_slot(f.buf).is_some())?;
            let e = entry_named(s, f.buf);
            let size = elem_size(e.dtype);
            if size < 2 || a.ptr(f) == 0 {
                return None;
            }
            let k = 1 + below(rng, size - 1);
            let p = a.ptr(f) + k;
            a.set_ptr(f, p);
            (format!("{} + {k}", f.name), invalid_named(f.buf, &[&["align"]]))
        }
        OverlappingPointer => {
            let present = |a: &mut CArgs, f: &CField| {
                f.kind.is_ptr() && a.ptr(f) != 0 && field_slot(s, f).is_some_and(|sl| sl.bytes > 64)
            };
            let candidates: Vec<CField> = api.fields.iter().filter(|f| present(&mut a, f)).copied().collect();
            let n = *pick(rng, candidates.first().map(|_| &candidates[..])?);
            let others: Vec<CField> =
                candidates.iter().filter(|m| m.buf != n.buf && (n.kind.writes() || m.kind.writes())).copied().collect();
            let m = *pick(rng, others.first().map(|_| &others[..])?);
            let (target, bytes) = (a.ptr(&m), field_slot(s, &m).unwrap().bytes);
            let at = if below(rng, 3) == 0 { target - 64 } else { target + 64 * below(rng, bytes.div_ceil(64)) };
            a.set_ptr(&n, at);
            (format!("{} at {:+} bytes of {}", n.name, at as isize - target as isize, m.name), invalid(&[&["overlap"]]))
        }
        SharedInputs => {
            // Indices and boundaries must keep their values: not another input's bytes.
            let n = *pick_field(api, rng, |f| {
                matches!(f.kind, K::In | K::Opt)
                    && !matches!(f.buf, "state_batch_indices" | "cu_seqlens")
                    && s.named_slot(f.buf).is_some()
            })?;
            let need = field_slot(s, &n).unwrap().bytes;
            let m = *pick_field(api, rng, |f| {
                matches!(f.kind, K::In | K::Opt)
                    && f.buf != n.buf
                    && field_slot(s, f).is_some_and(|sl| sl.bytes >= need)
            })?;
            let p = a.ptr(&m);
            a.set_ptr(&n, p);
            (format!("{} shares {}'s buffer", n.name, m.name), Expect::Ok)
        }
        FlagFlip => {
            let f = *pick_field(api, rng, |f| f.kind == K::Flag)?;
            let b = a.bool(&f);
            let e = match f.name {
                "d_per_channel" if a.ptr(field(api, "d")) == 0 => Expect::Ok,
                "d_per_channel" if b => either(&[SHAPE]),
                "d_per_channel" => return None, // would describe a larger D
                _ => Expect::Ok,
            };
            a.set_bool(&f, !b);
            (format!("{} = {}", f.name, !b), e)
        }
        DtLimits => {
            if !api.op.is_ssd() {
                return None;
            }
            let f = *pick_field(api, rng, |f| f.kind == K::Float)?;
            a.set_f32(&f, *pick(rng, &ODD_FLOATS));
            let (lo, hi) = (a.f32(field(api, "dt_min")), a.f32(field(api, "dt_max")));
            let e = if dt_limits_ok(lo, hi) { Expect::Ok } else { invalid_named("dt_min", &[]) };
            (format!("dt_min = {lo}, dt_max = {hi}"), e)
        }
        BoundaryValues => {
            let cu = s.cu_seqlens()?;
            let seqlen = a.i64(field(api, "seqlen"));
            let (values, expect) = boundary_values(rng, &cu, seqlen);
            a.set_ptr(field(api, "cu_seqlens"), values.as_ptr() as usize);
            let what = format!("cu_seqlens = {values:?}");
            keep = Some(values);
            (what, expect)
        }
    };
    Some(CCase { args: Some(a), _keep: keep, expect, region, what })
}

fn entry_named<'a>(s: &'a Setup, name: &str) -> &'a Entry {
    match s.operand(name) {
        Some(i) => &s.call.operands[i],
        None => &s.call.results[s.result(name).unwrap()],
    }
}

fn last_error() -> String {
    // SAFETY: a NUL-terminated string owned by the library, valid until its next call.
    unsafe { CStr::from_ptr(xla_ssm_last_error()) }.to_string_lossy().into_owned()
}

fn c_code(status: XlaSsmStatus) -> Code {
    match status {
        XLA_SSM_INVALID_ARGUMENT => Code::Invalid,
        XLA_SSM_CUDA_ERROR => Code::Cuda,
        XLA_SSM_UNIMPLEMENTED => Code::Unimplemented,
        XLA_SSM_INTERNAL => Code::Internal,
        other => Code::Other(other),
    }
}

fn c_outcome(status: XlaSsmStatus) -> Outcome {
    if status == XLA_SSM_OK {
        let e = last_error();
        if !e.is_empty() {
            return Outcome::Err(Code::Other(0), format!("success, but last_error says {e:?}"));
        }
        return Outcome::Ok;
    }
    Outcome::Err(c_code(status), last_error())
}

#[test]
fn c_api_refuses_bad_arguments() {
    let set = settings();
    let cases = set.cases * 3 / 10;
    let mut setups: Vec<(Setup, CApi)> = fixture_calls()
        .into_iter()
        .enumerate()
        .filter_map(|(k, c)| {
            let api = c_api_of(Op::of(&c.target))?;
            Some((Setup::new(c, 500 + k as u64), api))
        })
        .collect();
    for op in [Op::ScanFwd, Op::ScanBwd, Op::SsdFwd, Op::SsdBwd, Op::StateUpdate, Op::Decode] {
        assert!(setups.iter().any(|(s, _)| s.op == op), "no fixture call for the C API of {op:?}");
    }
    let cuda_ok = cuda_calls_allowed();
    let start = Instant::now();
    let mut tally = Tally::default();
    for i in 0..cases {
        if set.only.is_some_and(|o| o != i) {
            continue;
        }
        let mut rng = case_rng(set.seed, 2, i);
        let kind = CKINDS[(i % CKINDS.len() as u64) as usize];
        let first = (i / CKINDS.len() as u64) as usize;
        let mut found = None;
        for k in 0..setups.len() * 3 {
            let idx = (first + k) % setups.len();
            let (s, api) = &setups[idx];
            if let Some(case) = gen_c(kind, s, api, &mut rng) {
                found = Some((idx, case));
                break;
            }
        }
        let Some((idx, case)) = found else { continue };
        let (s, api) = &mut setups[idx];
        let cuda = cuda_ok && below(&mut rng, 4) == 0;
        let label = format!(
            "case {i} [{kind:?}] {} {}_{}: {}",
            s.call.id,
            api.name,
            if cuda { "cuda_launch" } else { "host" },
            case.what
        );
        if set.trace {
            eprintln!("{label}");
        }
        s.reset();
        let ptr = case.args.as_ref().map_or(std::ptr::null(), CArgs::as_ptr);
        let status = if cuda { (api.cuda)(ptr) } else { (api.host)(ptr) };
        let outcome = c_outcome(status);
        tally.record(&format!("{kind:?}"), api.name, &outcome);
        match judge(&case.expect, cuda, &outcome) {
            Err(why) => tally.fail(format!("{label}: {why}, got {outcome:?}")),
            Ok(wrote) => {
                let mut allowed = vec![];
                if let (true, Some(mut a)) = (wrote, case.args) {
                    for f in api.fields.iter().filter(|f| f.kind.writes()) {
                        if let Some(slot) = field_slot(s, f) {
                            let len = if case.region == Region::Slot { slot.cap } else { slot.bytes };
                            allowed.push((a.ptr(f), len));
                        }
                    }
                }
                if let Err(why) = s.check_writes(&allowed) {
                    tally.fail(format!("{label}: {why} (outcome {outcome:?})"));
                }
            }
        }
    }
    if set.only.is_none() {
        for &kind in CKINDS {
            assert!(tally.by_kind.contains_key(&format!("{kind:?}")), "no case of {kind:?} ran");
        }
    }
    tally.finish("c_api_refuses_bad_arguments", start, &set);
}

// ---------------------------------------------------------------------------------------------
// The sizers, the chunk_states dtype and the registration.

const ODD_SIZES: [i64; 10] = [0, -1, i64::MIN, i64::MAX, 1 << 48, 1 << 49, 1 << 62, 257, 33, 3];
const ODD_CODES: [i32; 6] = [-1, 3, 4, 99, i32::MIN, i32::MAX];

thread_local! {
    /// Calls of the fake `XLA_FFI_Handler_Register`, and whether it fails.
    static REGISTERED: std::cell::RefCell<(Vec<String>, bool)> = const { std::cell::RefCell::new((Vec::new(), false)) };
}

/// The fake runtime's handler registration: checks the argument struct, records the name, and
/// succeeds (or fails, when asked to).
unsafe extern "C" fn fake_register(args: *mut c_void) -> *mut c_void {
    #[repr(C)]
    struct RegisterArgs {
        struct_size: usize,
        extension_start: *mut c_void,
        name: ByteSpan,
        platform: ByteSpan,
        bundle: [Option<unsafe extern "C" fn()>; 4],
        traits: u32,
    }
    let a = &*(args as *const RegisterArgs);
    let name = String::from_utf8_lossy(std::slice::from_raw_parts(a.name.ptr as *const u8, a.name.len)).into_owned();
    let sane = a.struct_size == 84 && a.bundle[3].is_some() && a.bundle[..3].iter().all(Option::is_none);
    let fail = REGISTERED.with(|r| {
        let mut r = r.borrow_mut();
        r.0.push(if sane { name } else { format!("malformed registration of {name}") });
        r.1
    });
    if !fail {
        return std::ptr::null_mut();
    }
    let api = xla::api();
    let msg = CString::new("fake runtime: registration refused").unwrap();
    let mut create = xla::ErrorCreateArgs {
        struct_size: 32,
        extension_start: std::ptr::null_mut(),
        message: msg.as_ptr(),
        errc: xla::ERR_INVALID_ARGUMENT,
    };
    (api.error_create.unwrap())(&mut create)
}

/// (batch, seqlen, heads, headdim, dstate, groups, chunk_size) and the dtype code of an SSD call.
type SsdSizes = ([i64; 7], i32);

/// What the fixture calls give the sizers: (batch, dim, seqlen, dstate, groups) of the scans and
/// (batch, seqlen, heads, headdim, dstate, groups, chunk_size, dtype) of the SSD calls.
fn sizer_shapes() -> (Vec<[i64; 5]>, Vec<SsdSizes>) {
    let mut scans = vec![];
    let mut ssds = vec![];
    for (k, call) in fixture_calls().into_iter().enumerate() {
        let s = Setup::new(call, k as u64);
        if let Some(api) = c_api_of(s.op) {
            let mut a = c_base(&s, &api);
            let v = |a: &mut CArgs, n: &str| a.i64(field(&api, n));
            match s.op {
                Op::ScanFwd | Op::ScanBwd => scans.push([
                    v(&mut a, "batch"),
                    v(&mut a, "dim"),
                    v(&mut a, "seqlen"),
                    v(&mut a, "dstate"),
                    v(&mut a, "groups"),
                ]),
                Op::SsdFwd | Op::SsdBwd => ssds.push((
                    ["batch", "seqlen", "heads", "headdim", "dstate", "groups", "chunk_size"].map(|n| v(&mut a, n)),
                    a.i32(field(&api, "dtype")),
                )),
                _ => {}
            }
        }
    }
    (scans, ssds)
}

#[test]
fn sizers_and_registration_refuse_bad_arguments() {
    let set = settings();
    let cases = (set.cases / 20).max(40);
    let (scans, ssds) = sizer_shapes();
    let start = Instant::now();
    let mut tally = Tally::default();
    for i in 0..cases {
        if set.only.is_some_and(|o| o != i) {
            continue;
        }
        let mut rng = case_rng(set.seed, 3, i);
        let which = i % 7;
        let mutate = |rng: &mut Rng, v: i64| if below(rng, 5) < 2 { v } else { *pick(rng, &ODD_SIZES) };
        let (name, label, outcome, expect): (&str, String, Outcome, Expect) = match which {
            0..=3 => {
                // The workspace sizers: -1 and a message naming the problem, or a size and no message.
                let (name, args, dtype, got) = if which < 2 {
                    let base = *pick(&mut rng, &scans);
                    let mut args: Vec<i64> = base.iter().map(|&v| mutate(&mut rng, v)).collect();
                    if which == 0 {
                        args.truncate(4); // the forward's sizer takes no groups
                    }
                    let got = if which == 0 {
                        xla_ssm_selective_scan_fwd_workspace_bytes(args[0], args[1], args[2], args[3])
                    } else {
                        xla_ssm_selective_scan_bwd_workspace_bytes(args[0], args[1], args[2], args[3], args[4])
                    };
                    let name =
                        ["selective_scan_fwd_workspace_bytes", "selective_scan_bwd_workspace_bytes"][which as usize];
                    (name, args, XLA_SSM_F32, got)
                } else {
                    let (base, dtype) = *pick(&mut rng, &ssds);
                    let args: Vec<i64> = base.iter().map(|&v| mutate(&mut rng, v)).collect();
                    let dtype = if below(&mut rng, 4) == 0 { *pick(&mut rng, &ODD_CODES) } else { dtype };
                    let f = if which == 2 { xla_ssm_ssd_fwd_workspace_bytes } else { xla_ssm_ssd_bwd_workspace_bytes };
                    let got = f(args[0], args[1], args[2], args[3], args[4], args[5], args[6], dtype);
                    let name = ["ssd_fwd_workspace_bytes", "ssd_bwd_workspace_bytes"][which as usize - 2];
                    (name, args, dtype, got)
                };
                let label = format!("case {i} [sizer] xla_ssm_{name}({args:?}, dtype {dtype})");
                let err = last_error();
                let outcome = match got {
                    -1 => Outcome::Err(Code::Invalid, err),
                    n if n >= 0 && err.is_empty() => Outcome::Ok,
                    n => Outcome::Err(Code::Other(n as i32), format!("returned {n}, last_error {err:?}")),
                };
                let bad = args.iter().any(|&v| v < 0) || !(0..=2).contains(&dtype);
                let mut needles: Vec<&str> = SHAPE.to_vec();
                needles.extend(["dtype", "divide"]);
                let expect =
                    if bad { Expect::Invalid(vec![words(&needles)]) } else { Expect::Either(vec![words(&needles)]) };
                (name, label, outcome, expect)
            }
            4 => {
                let (base, dtype) = *pick(&mut rng, &ssds);
                let [headdim, dstate, chunk] = [base[3], base[4], base[6]].map(|v| mutate(&mut rng, v));
                let dtype = if below(&mut rng, 3) == 0 { *pick(&mut rng, &ODD_CODES) } else { dtype };
                let got = xla_ssm_ssd_chunk_states_dtype(headdim, dstate, chunk, dtype);
                let label = format!("case {i} [chunk_states_dtype] ({headdim}, {dstate}, {chunk}, {dtype}) = {got}");
                let valid = (0..=2).contains(&dtype);
                let outcome = match got {
                    -1 => Outcome::Err(Code::Invalid, "-1".into()),
                    n if n == XLA_SSM_F32 || n == dtype => Outcome::Ok,
                    n => Outcome::Err(Code::Other(n), format!("{n} is neither f32 nor the dtype")),
                };
                let expect = if valid { Expect::Ok } else { invalid(&[&["-1"]]) };
                ("ssd_chunk_states_dtype", label, outcome, expect)
            }
            _ => {
                // Registration with a host's API table.
                let mut api = xla::api();
                // SAFETY: the table's entry is a C function pointer; the library calls it with the
                // `XLA_FFI_Handler_Register` signature, which `fake_register` has.
                api.handler_register = Some(unsafe {
                    std::mem::transmute::<unsafe extern "C" fn(*mut c_void) -> *mut c_void, unsafe extern "C" fn()>(
                        fake_register,
                    )
                });
                let mut platform: Vec<u8> = pick(&mut rng, &["Host", "cpu", "CUDA", "gpu", "HOST"]).as_bytes().to_vec();
                let mut null_api = false;
                let mut null_platform = false;
                let mut fail = false;
                let variant = below(&mut rng, 8);
                let expect = match variant {
                    0 => Expect::Ok,
                    1 => {
                        null_api = true;
                        invalid_named("api", &[&["null"]])
                    }
                    2 => {
                        null_platform = true;
                        invalid_named("platform", &[&["null"]])
                    }
                    3 => {
                        platform = pick(&mut rng, &[&b"tpu"[..], b"", b"CUDA ", b"\xff\xfe", b"rocm"]).to_vec();
                        invalid(&[&["platform"]])
                    }
                    4 => {
                        api.struct_size = *pick(&mut rng, &[0usize, 48, 80]);
                        invalid(&[&["API table"]])
                    }
                    5 => {
                        api.api_version.major_version = *pick(&mut rng, &[1, -1]);
                        invalid(&[&["API table"]])
                    }
                    6 => {
                        api.handler_register = None;
                        invalid(&[&["XLA_FFI_Handler_Register"]])
                    }
                    _ => {
                        fail = true;
                        Expect::HostError("registration refused")
                    }
                };
                REGISTERED.with(|r| *r.borrow_mut() = (Vec::new(), fail));
                let c_platform = CString::new(platform.clone()).unwrap();
                let api_ptr = if null_api { std::ptr::null() } else { &api as *const xla::Api };
                let platform_ptr: *const c_char = if null_platform { std::ptr::null() } else { c_platform.as_ptr() };
                // SAFETY: a live table of the fake runtime (or NULL) and a NUL-terminated string (or NULL).
                let status = unsafe {
                    xla_ssm::xla::register::xla_ssm_register_xla_targets(
                        api_ptr as *const xla_ssm::xla::ffi::XLA_FFI_Api,
                        platform_ptr,
                    )
                };
                let mut outcome = c_outcome(status);
                let registered = REGISTERED.with(|r| r.borrow().0.clone());
                let names: Vec<&str> = xla_ssm::xla::register::TARGETS.iter().map(|t| t.name).collect();
                if matches!(outcome, Outcome::Ok) && registered != names {
                    outcome = Outcome::Err(Code::Other(0), format!("registered {registered:?}"));
                }
                let label =
                    format!("case {i} [register] variant {variant}, platform {:?}", String::from_utf8_lossy(&platform));
                ("register_xla_targets", label, outcome, expect)
            }
        };
        if set.trace {
            eprintln!("{label}");
        }
        tally.record(name, name, &outcome);
        if let Err(why) = judge(&expect, false, &outcome) {
            tally.fail(format!("{label}: {why}, got {outcome:?}"));
        }
    }
    tally.finish("sizers_and_registration_refuse_bad_arguments", start, &set);
}
