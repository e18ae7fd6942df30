//! The kernel parameter structs cross from Rust to CUDA by value, laid out on the CUDA side by
//! kernels/params.h, which cbindgen generates from the Rust structs (tests/suite/headers.rs keeps it
//! current). Here the system C compiler reads that header and prints the offset and size of every
//! field, by the names the kernels use, and the size and alignment of every struct; each must equal
//! Rust's. Sizes alone would pass two swapped fields of one type.

use std::collections::BTreeMap;
use std::mem::{align_of, offset_of, size_of};
use std::path::Path;
use std::process::Command;
use xla_ssm::ops::conv1d::ConvParams;
use xla_ssm::ops::mamba_decode::DecodeParams;
use xla_ssm::ops::selective_scan::carry::CarryParams;
use xla_ssm::ops::selective_scan::{BwdParams, BwdReduceParams, FwdParams};
use xla_ssm::ops::ssd::plan::MmaFwdSplit;
use xla_ssm::ops::ssd::{BwdMmaParams, FwdMmaParams, Gather, GlueParams, SplitHeadsParams, SsdBwdParams, SsdParams};
use xla_ssm::ops::state_update::UpdateParams;

/// The header as of this test's build (the test needs no source tree to run).
const HEADER: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/params.h"));

/// What Rust says of a struct: its C name, size, alignment, and (C name, offset, size) per field.
struct Layout {
    c_name: &'static str,
    size: usize,
    align: usize,
    fields: Vec<(&'static str, usize, usize)>,
}

fn field_size<S, F>(_: fn(&S) -> &F) -> usize {
    size_of::<F>()
}

/// The field's C name: its Rust name unless one is given.
macro_rules! c_name {
    ($field:ident) => {
        stringify!($field)
    };
    ($field:ident $c:literal) => {
        $c
    };
}

/// `RustStruct => "CStruct" { field, field => "CName", ... }`, every field of the struct listed:
/// the destructuring without `..` makes a missing one a compile error.
macro_rules! layouts {
    ($($rust:ident => $c_struct:literal { $($field:ident $(=> $c_field:literal)?),* $(,)? })*) => {
        vec![$({
            const _: fn($rust) = |s| {
                let $rust { $($field: _),* } = s;
            };
            Layout {
                c_name: $c_struct,
                size: size_of::<$rust>(),
                align: align_of::<$rust>(),
                fields: vec![$((
                    c_name!($field $($c_field)?),
                    offset_of!($rust, $field),
                    field_size(|s: &$rust| &s.$field),
                )),*],
            }
        }),*]
    };
}

/// Every struct in kernels/params.h, with the C names of the fields whose Rust names differ.
fn rust_layouts() -> Vec<Layout> {
    layouts! {
        FwdParams => "SelectiveScanFwdParams" {
            u, delta, a => "A", b => "B", c => "C", d => "D", z, delta_bias, initial_state, out, final_state,
            batch, dim, seqlen, dstate, dim_per_group, x_stride_batch, x_stride_dim, x_stride_seq,
            bc_stride_batch, bc_stride_group, bc_stride_state, bc_stride_seq, delta_softplus, _reserved,
            workspace, chunk_len, n_chunks, checkpoints, checkpoint_len, cu_seqlens, num_seqs,
        }
        BwdParams => "SelectiveScanBwdParams" {
            fwd, dout, dfinal_state, du, ddelta, da => "dA", db => "dB", dc => "dC", dd => "dD", dz,
            ddelta_bias, dinitial_state,
        }
        BwdReduceParams => "SelectiveScanBwdReduceParams" {
            q, tiles_per_group, bc_part, groups, varying_bc, _reserved,
        }
        CarryParams => "SelectiveScanCarryParams" {
            scan, dt_sums, dstate_parts, segment_len, n_segments,
        }
        UpdateParams => "StateUpdateParams" {
            state, x, dt, a => "A", b => "B", c => "C", d => "D", z, dt_bias, state_batch_indices, out,
            batch, dim, dstate, groups, dim_per_group, n_slots, dt_softplus, vectorized, lanes, _reserved,
        }
        ConvParams => "ConvParams" {
            x, weight, bias, initial_states, conv_state, state_batch_indices, out, dout, dweight, dbias,
            dinitial_states, batch, dim, seqlen, width, n_slots, x_stride_batch, x_stride_dim, x_stride_seq,
            silu, _reserved, cu_seqlens, num_seqs,
        }
        DecodeParams => "DecodeParams" { ssm, conv_state, conv_weight, conv_bias, width }
        SsdParams => "SsdParams" {
            x, dt, a => "A", b => "B", c => "C", d => "D", z, dt_bias, initial_states, y, final_states,
            chunk_states, workspace, workspace_bytes, batch, seqlen, heads, headdim, dstate, groups,
            chunk_size, dt_min, dt_max, dt_softplus, d_per_channel => "D_per_channel", cu_seqlens, num_seqs,
        }
        SsdBwdParams => "SsdBwdParams" {
            fwd, dy, dfinal_states, dx, ddt, da => "dA", db => "dB", dc => "dC", dd => "dD", dz, ddt_bias,
            dinitial_states,
        }
        GlueParams => "SsdGlueParams" {
            q, delta, a => "A", d => "D", dt_bias, ddelta, da => "dA", dd => "dD", ddelta_bias, ddt_f32,
            transformed, _reserved, chunk_states_f32,
        }
        SplitHeadsParams => "SsdSplitHeadsParams" {
            q, ways, dt, a => "A", d => "D", dt_bias, ddt, da => "dA", dd => "dD", ddt_bias,
        }
        Gather => "SsdGather" { src, dst, dims, strides, second, zero_from, dst_cols }
        MmaFwdSplit => "FwdSplit" { tiles_per_part, n_parts, records_per_part }
        FwdMmaParams => "SsdMmaParams" { p, split, scalars_in_y }
        BwdMmaParams => "SsdBwdMmaParams" {
            q, gated, scratch, da_part, dbias_part, dd_part, records, chunks_per_part, n_parts,
            records_per_part, s_chunk, ds_chunk, scal, msum, msum_split, db_part, dc_part,
        }
    }
}

/// The structs of the header and their fields' names, in order (cbindgen's layout: `typedef struct
/// Name {`, a field per line, `} Name;`).
fn header_structs() -> BTreeMap<String, Vec<String>> {
    let mut structs = BTreeMap::new();
    let mut current: Option<(String, Vec<String>)> = None;
    for line in HEADER.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("typedef struct ").and_then(|l| l.strip_suffix(" {")) {
            current = Some((name.to_string(), Vec::new()));
        } else if line.starts_with('}') {
            if let Some((name, fields)) = current.take() {
                structs.insert(name, fields);
            }
        } else if let (Some((_, fields)), Some(decl)) = (current.as_mut(), line.strip_suffix(';')) {
            if !line.starts_with("//") {
                let name = decl.rsplit([' ', '*']).next().unwrap_or(decl);
                // An array's name without its extent (`dims[4]`): sizeof checks the extent.
                fields.push(name.split('[').next().unwrap_or(name).to_string());
            }
        }
    }
    structs
}

/// A C program that prints `Struct size align` and `Struct.field offset size` for every struct.
fn c_program(layouts: &[Layout]) -> String {
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n\
         /* CUDA's vector type: the header only points to it. */\ntypedef struct float2 float2;\n\
         #include \"params.h\"\n\
         #define STRUCT(S) printf(#S \" %zu %zu\\n\", sizeof(S), _Alignof(S))\n\
         #define FIELD(S, f) printf(#S \".\" #f \" %zu %zu\\n\", offsetof(S, f), sizeof(((S *)0)->f))\n\
         int main(void) {\n",
    );
    for l in layouts {
        c += &format!("    STRUCT({});\n", l.c_name);
        for (field, _, _) in &l.fields {
            c += &format!("    FIELD({}, {field});\n", l.c_name);
        }
    }
    c + "    return 0;\n}\n"
}

/// Compiles and runs `source` against the header; its output.
fn compile_and_run(source: &str) -> String {
    let mut work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernel_params");
    if std::fs::create_dir_all(&work).is_err() {
        work = std::env::temp_dir().join(format!("xla_ssm_kernel_params_{}", std::process::id()));
        std::fs::create_dir_all(&work).unwrap();
    }
    std::fs::write(work.join("params.h"), HEADER).unwrap();
    std::fs::write(work.join("layout.c"), source).unwrap();
    let target = format!("{}-unknown-linux-gnu", std::env::consts::ARCH);
    let compiler = cc::Build::new()
        .opt_level(0)
        .debug(false)
        .target(&target)
        .host(&target)
        .cargo_metadata(false)
        .out_dir(&work)
        .try_get_compiler()
        .unwrap_or_else(|e| panic!("this test needs a C compiler (set CC to one): {e}"));
    let exe = work.join("layout");
    let mut cmd = compiler.to_command();
    cmd.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
        .arg(&work)
        .arg(work.join("layout.c"))
        .arg("-o")
        .arg(&exe);
    let built = cmd.output().unwrap_or_else(|e| panic!("this test needs a C compiler; could not run {cmd:?}: {e}"));
    assert!(
        built.status.success(),
        "compiling the layout program against kernels/params.h failed:\n{cmd:?}\n{}{}",
        String::from_utf8_lossy(&built.stdout),
        String::from_utf8_lossy(&built.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    assert!(run.status.success(), "{} failed: {}", exe.display(), String::from_utf8_lossy(&run.stderr));
    String::from_utf8(run.stdout).unwrap()
}

#[test]
fn every_struct_and_field_of_the_header_is_checked() {
    let header = header_structs();
    let listed: BTreeMap<String, Vec<String>> = rust_layouts()
        .iter()
        .map(|l| {
            let mut fields = l.fields.clone();
            fields.sort_by_key(|f| f.1);
            (l.c_name.to_string(), fields.iter().map(|f| f.0.to_string()).collect())
        })
        .collect();
    assert!(!header.is_empty(), "no structs found in kernels/params.h");
    assert_eq!(header, listed, "kernels/params.h (left) and the structs this test checks (right, by offset)");
}

#[test]
fn c_layout_of_the_header_is_rusts() {
    let layouts = rust_layouts();
    let out = compile_and_run(&c_program(&layouts));
    let c: BTreeMap<&str, (usize, usize)> = out
        .lines()
        .map(|line| {
            let mut words = line.split(' ');
            let mut next = || words.next().unwrap_or_else(|| panic!("bad line {line:?}"));
            let name = next();
            let (a, b) = (next().parse().unwrap(), next().parse().unwrap());
            (name, (a, b))
        })
        .collect();
    let mut wrong = Vec::new();
    for l in &layouts {
        let want = (l.size, l.align);
        if c.get(l.c_name) != Some(&want) {
            wrong.push(format!("{}: C (size, align) {:?}, Rust {want:?}", l.c_name, c.get(l.c_name)));
        }
        for &(field, offset, size) in &l.fields {
            let name = format!("{}.{field}", l.c_name);
            if c.get(name.as_str()) != Some(&(offset, size)) {
                wrong.push(format!("{name}: C (offset, size) {:?}, Rust {:?}", c.get(name.as_str()), (offset, size)));
            }
        }
    }
    assert!(wrong.is_empty(), "kernels/params.h lays the structs out unlike Rust:\n  {}", wrong.join("\n  "));
}
