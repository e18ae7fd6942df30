//! Packed sequences (`cu_seqlens`) in `causal_conv1d_fwd` / `_bwd`, through the XLA handlers: a
//! packed call's out, dx and dinitial_states equal those of one unpacked call per sequence put
//! together, and its dweight and dbias their sums, over random boundaries (empty, length-1 and
//! shorter-than-the-window sequences), with and without initial states, bias and SiLU, both layouts,
//! every dtype pair and width. Bad boundaries and shapes are refused on the CPU.
//! `cuda_matches_cpu` compares the CUDA target with the CPU one on packed problems.

use crate::common::xla::{Attr, Handler, F32 as XLA_F32};
use crate::common::{assert_close, Dt, Rng, Tol};
use crate::decode_common::*;
use xla_ssm::xla::handlers as h;

/// Runs a call through a handler on some platform: the results' bytes, or (code, message).
type RunCall<'a> = dyn Fn(Handler, &Call) -> Result<Vec<Vec<u8>>, (i32, String)> + 'a;

/// One packed problem: batch 1, `cu` boundaries along seqlen.
#[derive(Clone, Debug)]
struct Packed {
    /// batch 1, seqlen cu[-1]; `has_init`: initial states of num_seqs rows.
    k: ConvCase,
    cu: Vec<i32>,
    x: Vec<f32>,
    w: Vec<f32>,
    bias: Vec<f32>,
    /// (num_seqs, dim, width - 1).
    init: Vec<f32>,
    dout: Vec<f32>,
}

/// The results of a forward and a backward, as f32 (decoded from their dtypes).
#[derive(Debug, Default)]
struct Results {
    out: Vec<f32>,
    dx: Vec<f32>,
    dweight: Vec<f32>,
    dbias: Vec<f32>,
    dinit: Vec<f32>,
}

impl Packed {
    fn new(k: ConvCase, lens: &[usize]) -> Packed {
        let mut cu = vec![0i32];
        for &l in lens {
            cu.push(cu.last().unwrap() + l as i32);
        }
        let k = ConvCase { batch: 1, seqlen: *cu.last().unwrap() as usize, ..k };
        let mut rng = Rng::new(k.seed * 7919 + 11);
        let n = k.dim * k.seqlen;
        Packed {
            x: randn(&mut rng, k.dtype, n, 1.0),
            w: randn(&mut rng, k.wdtype, k.dim * k.width, 0.5),
            bias: randn(&mut rng, k.wdtype, k.dim, 0.5),
            init: randn(&mut rng, k.dtype, lens.len() * k.dim * (k.width - 1), 1.0),
            dout: randn(&mut rng, k.dtype, n, 1.0),
            k,
            cu,
        }
    }

    fn num_seqs(&self) -> usize {
        self.cu.len() - 1
    }

    /// Index of (d, t) in a batch-1 x of `len` steps.
    fn xi(&self, len: usize, d: usize, t: usize) -> usize {
        if self.k.bld {
            t * self.k.dim + d
        } else {
            d * len + t
        }
    }

    /// Steps t0..t0 + len of a batch-1 array of x's shape.
    fn slice(&self, v: &[f32], t0: usize, len: usize) -> Vec<f32> {
        let mut o = vec![0f32; self.k.dim * len];
        for d in 0..self.k.dim {
            for t in 0..len {
                o[self.xi(len, d, t)] = v[self.xi(self.k.seqlen, d, t0 + t)];
            }
        }
        o
    }

    fn unslice(&self, v: &mut [f32], part: &[f32], t0: usize, len: usize) {
        for d in 0..self.k.dim {
            for t in 0..len {
                v[self.xi(self.k.seqlen, d, t0 + t)] = part[self.xi(len, d, t)];
            }
        }
    }

    fn attrs(&self, packed: bool) -> Vec<(&'static str, Attr)> {
        let k = &self.k;
        let mut attrs = vec![
            ("silu", Attr::Bool(k.silu)),
            ("layout", Attr::Str(if k.bld { "bld" } else { "bdl" }.into())),
            ("has_bias", Attr::Bool(k.has_bias)),
            ("has_initial_states", Attr::Bool(k.has_init)),
        ];
        if packed {
            attrs.push(("has_cu_seqlens", Attr::Bool(true)));
        }
        attrs
    }

    /// The packed forward and backward calls (results poisoned).
    fn calls(&self) -> (Call, Call) {
        let k = &self.k;
        let (x_dims, w1, rows) = (k.x_dims(), k.width - 1, self.num_seqs());
        let mut optional = vec![];
        if k.has_bias {
            optional.push(arr(k.wdtype, &[k.dim], &self.bias));
        }
        if k.has_init {
            optional.push(arr(k.dtype, &[rows, k.dim, w1], &self.init));
        }
        optional.push(indices_arr(&self.cu));
        let x = arr(k.dtype, &x_dims, &self.x);
        let w = arr(k.wdtype, &[k.dim, k.width], &self.w);
        let mut fwd_args = vec![x.clone(), w.clone()];
        fwd_args.extend(optional.iter().cloned());
        let fwd = Call { args: fwd_args, rets: vec![(poisoned(k.dtype, &x_dims), None)], attrs: self.attrs(true) };
        let mut bwd_args = vec![x, w, arr(k.dtype, &x_dims, &self.dout)];
        bwd_args.extend(optional);
        let mut rets = vec![(poisoned(k.dtype, &x_dims), None), (poisoned(k.wdtype, &[k.dim, k.width]), None)];
        if k.has_bias {
            rets.push((poisoned(k.wdtype, &[k.dim]), None));
        }
        if k.has_init {
            rets.push((poisoned(k.dtype, &[rows, k.dim, w1]), None));
        }
        (fwd, Call { args: bwd_args, rets, attrs: self.attrs(true) })
    }

    fn decode(&self, fwd: &[Vec<u8>], bwd: &[Vec<u8>]) -> Results {
        let k = &self.k;
        let mut rest = bwd[2..].iter();
        let dbias = if k.has_bias { k.wdtype.decode(rest.next().unwrap()) } else { vec![] };
        let dinit = if k.has_init { k.dtype.decode(rest.next().unwrap()) } else { vec![] };
        Results {
            out: k.dtype.decode(&fwd[0]),
            dx: k.dtype.decode(&bwd[0]),
            dweight: k.wdtype.decode(&bwd[1]),
            dbias,
            dinit,
        }
    }

    /// The packed call through the CPU or (`cuda`) the CUDA handlers, which `run` runs.
    fn run_packed(&self, run: &RunCall, cuda: bool) -> Results {
        let (fwd, bwd) = self.calls();
        let (hf, hb) = if cuda {
            (h::xla_ssm_causal_conv1d_fwd_cuda as Handler, h::xla_ssm_causal_conv1d_bwd_cuda as Handler)
        } else {
            (h::xla_ssm_causal_conv1d_fwd_cpu as Handler, h::xla_ssm_causal_conv1d_bwd_cpu as Handler)
        };
        let f = run(hf, &fwd).unwrap_or_else(|(c, m)| panic!("packed fwd failed ({c}): {m}\n{self:?}"));
        let b = run(hb, &bwd).unwrap_or_else(|(c, m)| panic!("packed bwd failed ({c}): {m}\n{self:?}"));
        self.decode(&f, &b)
    }

    /// One unpacked CPU call per sequence, the results put together as the packed call's: out, dx
    /// and dinitial_states side by side, dweight and dbias summed (in f64, then rounded to f32).
    fn per_sequence(&self) -> Results {
        let k = &self.k;
        let (w1, rows) = (k.width - 1, self.num_seqs());
        let mut all = Results {
            out: vec![0.0; self.x.len()],
            dx: vec![0.0; self.x.len()],
            dinit: vec![0.0; if k.has_init { rows * k.dim * w1 } else { 0 }],
            ..Results::default()
        };
        let mut dw = vec![0f64; k.dim * k.width];
        let mut db = vec![0f64; if k.has_bias { k.dim } else { 0 }];
        for s in 0..rows {
            let (t0, len) = (self.cu[s] as usize, (self.cu[s + 1] - self.cu[s]) as usize);
            let ks = ConvCase { seqlen: len, ..k.clone() };
            let inputs = ConvInputs {
                x: self.slice(&self.x, t0, len),
                w: self.w.clone(),
                bias: self.bias.clone(),
                init: self.init[s * k.dim * w1..(s + 1) * k.dim * w1].to_vec(),
                dout: self.slice(&self.dout, t0, len),
            };
            let (fwd, _) = conv_fwd_call(&ks, &inputs);
            let (bwd, _) = conv_bwd_call(&ks, &inputs);
            let run = crate::ffi_cpu_decode::run;
            let f = run(h::xla_ssm_causal_conv1d_fwd_cpu, &fwd).unwrap();
            let b = run(h::xla_ssm_causal_conv1d_bwd_cpu, &bwd).unwrap();
            let part = Packed { k: ks, ..self.clone() }.decode(&f, &b);
            self.unslice(&mut all.out, &part.out, t0, len);
            self.unslice(&mut all.dx, &part.dx, t0, len);
            if k.has_init {
                all.dinit[s * k.dim * w1..(s + 1) * k.dim * w1].copy_from_slice(&part.dinit);
            }
            dw.iter_mut().zip(&part.dweight).for_each(|(a, &v)| *a += v as f64);
            db.iter_mut().zip(&part.dbias).for_each(|(a, &v)| *a += v as f64);
        }
        all.dweight = dw.iter().map(|&v| v as f32).collect();
        all.dbias = db.iter().map(|&v| v as f32).collect();
        all
    }
}

/// Results against others: `exact` for out, dx and dinitial_states (the same arithmetic per
/// element), `sums` for dweight and dbias.
fn compare(what: &str, p: &Packed, got: &Results, want: &Results, exact: Tol, sums: Tol) {
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    for (name, g, w, tol) in [
        ("out", &got.out, &want.out, exact),
        ("dx", &got.dx, &want.dx, exact),
        ("dinitial_states", &got.dinit, &want.dinit, exact),
        ("dweight", &got.dweight, &want.dweight, sums),
        ("dbias", &got.dbias, &want.dbias, sums),
    ] {
        assert_eq!(g.len(), w.len(), "{what}: {name} sizes\n{p:?}");
        if tol.rel_l2 == 0.0 {
            let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits() || (a == b));
            assert!(same, "{what}: {name} differs\ngot  {g:?}\nwant {w:?}\ncu {:?}", p.cu);
        } else {
            assert_close(&format!("{what}: {name}"), &p.cu, g, &f64s(w), tol);
        }
    }
}

const EXACT: Tol = Tol { rel_l2: 0.0, rel_max: 0.0 };

/// Sums of the same terms in another order (and, below f32, each sequence's sum rounded on its
/// own): a bound of the weights' dtype.
fn sums_tol(wdtype: Dt) -> Tol {
    match wdtype {
        Dt::F32 => Tol { rel_l2: 1e-5, rel_max: 1e-4 },
        other => Tol { rel_l2: other.tol().rel_l2 * 2.0, rel_max: other.tol().rel_max * 4.0 },
    }
}

fn below(rng: &mut Rng, n: usize) -> usize {
    (rng.next_u64() % n as u64) as usize
}

/// Random lengths adding up to `total`, with empty, length-1 and length-2 ones (shorter than a
/// width-4 window) among them, an empty one first or last at times.
fn lengths(rng: &mut Rng, total: usize) -> Vec<usize> {
    let mut lens = vec![0, 1, 2];
    let mut left = total.saturating_sub(3);
    while left > 0 {
        let l = match below(rng, 5) {
            0 => 0,
            1 => 1,
            2 => 2,
            _ => 1 + below(rng, left.min(40)),
        }
        .min(left);
        lens.push(l);
        left -= l;
    }
    for i in (1..lens.len()).rev() {
        lens.swap(i, below(rng, i + 1));
    }
    if below(rng, 2) == 0 {
        lens.push(0);
    }
    lens
}

fn cases() -> Vec<ConvCase> {
    let mut cases = Vec::new();
    let mut seed = 0;
    for (dtype, wdtype) in
        [(Dt::F32, Dt::F32), (Dt::BF16, Dt::BF16), (Dt::BF16, Dt::F32), (Dt::F16, Dt::F16), (Dt::F16, Dt::F32)]
    {
        for width in 2..=4 {
            for bld in [false, true] {
                for has_init in [false, true] {
                    seed += 1;
                    cases.push(ConvCase {
                        dtype,
                        wdtype,
                        bld,
                        has_bias: seed % 2 == 0,
                        has_init,
                        silu: seed % 3 != 0,
                        seed,
                        ..ConvCase::new(1, 3 + seed as usize % 4, 0, width)
                    });
                }
            }
        }
    }
    cases
}

#[test]
fn packed_equals_per_sequence_on_the_cpu() {
    let mut rng = Rng::new(0xc0417);
    let cpu = |h: Handler, c: &Call| crate::ffi_cpu_decode::run(h, c);
    for k in cases() {
        let total = 20 + below(&mut rng, 60);
        let lens = lengths(&mut rng, total);
        let p = Packed::new(k, &lens);
        compare("packed conv1d (cpu)", &p, &p.run_packed(&cpu, false), &p.per_sequence(), EXACT, sums_tol(p.k.wdtype));
    }
}

/// The packed results also against the f64 reference of each sequence (decode_common), so that a
/// packed call is right where the per-sequence path is.
#[test]
fn packed_matches_the_reference() {
    let mut rng = Rng::new(0x4ef);
    let cpu = |h: Handler, c: &Call| crate::ffi_cpu_decode::run(h, c);
    for k in cases().into_iter().step_by(3) {
        let lens = lengths(&mut rng, 30);
        let p = Packed::new(k, &lens);
        let got = p.run_packed(&cpu, false);
        let k = &p.k;
        let w1 = k.width - 1;
        for s in 0..p.num_seqs() {
            let (t0, len) = (p.cu[s] as usize, (p.cu[s + 1] - p.cu[s]) as usize);
            let ks = ConvCase { seqlen: len, ..k.clone() };
            let inputs = ConvInputs {
                x: p.slice(&p.x, t0, len),
                w: p.w.clone(),
                bias: p.bias.clone(),
                init: p.init[s * k.dim * w1..(s + 1) * k.dim * w1].to_vec(),
                dout: p.slice(&p.dout, t0, len),
            };
            let what = format!("sequence {s} of {:?}", p.cu);
            assert_close(
                &format!("{what}: out"),
                k,
                &p.slice(&got.out, t0, len),
                &conv_fwd_reference(&ks, &inputs),
                tol(k.dtype),
            );
            let [dx, _, _, dinit] = conv_bwd_reference(&ks, &inputs);
            assert_close(&format!("{what}: dx"), k, &p.slice(&got.dx, t0, len), &dx, tol(k.dtype));
            if k.has_init {
                let rows = &got.dinit[s * k.dim * w1..(s + 1) * k.dim * w1];
                assert_close(&format!("{what}: dinitial_states"), k, rows, &dinit, tol(k.dtype));
            }
        }
    }
}

#[test]
fn packed_zero_sizes() {
    let cpu = |h: Handler, c: &Call| crate::ffi_cpu_decode::run(h, c);
    // No sequence; only empty sequences (dinitial_states then 0); no channel.
    for (dim, lens) in [(3, vec![]), (3, vec![0, 0, 0]), (0, vec![2, 0, 3])] {
        let k = ConvCase { has_init: true, ..ConvCase::new(1, dim, 0, 4) };
        let p = Packed::new(k, &lens);
        let got = p.run_packed(&cpu, false);
        compare("packed zero sizes", &p, &got, &p.per_sequence(), EXACT, sums_tol(Dt::F32));
        assert!(got.dinit.iter().all(|&v| v == 0.0) && got.dweight.iter().all(|&v| v == 0.0));
    }
}

fn expect_invalid(call: &Call, handler: Handler, needles: &[&str]) {
    let (code, msg) = crate::ffi_cpu_decode::run(handler, call).expect_err("a bad call ran");
    assert_eq!(code, crate::common::xla::ERR_INVALID_ARGUMENT, "{msg}");
    for n in needles {
        assert!(msg.contains(n), "{msg:?} lacks {n:?}");
    }
}

#[test]
fn bad_boundaries_are_refused_on_the_cpu() {
    let p = Packed::new(ConvCase::new(1, 4, 0, 3), &[5, 0, 7]);
    let cu_index = |c: &Call| c.args.iter().position(|a| a.dtype == crate::common::xla::S32).unwrap();
    for (cu, needle) in [
        (vec![1, 5, 5, 12], "first"),
        (vec![0, 7, 5, 12], "decrease"),
        (vec![0, 5, 5, 11], "last"),
        (vec![0, 5, 5, 13], "last"),
        (vec![0, -1, 5, 12], "decrease"),
    ] {
        let (mut fwd, mut bwd) = p.calls();
        for (c, handler) in [
            (&mut fwd, h::xla_ssm_causal_conv1d_fwd_cpu as Handler),
            (&mut bwd, h::xla_ssm_causal_conv1d_bwd_cpu as Handler),
        ] {
            let i = cu_index(c);
            c.args[i] = indices_arr(&cu);
            expect_invalid(c, handler, &["`cu_seqlens`", needle]);
        }
    }
}

#[test]
fn packed_shapes_are_checked() {
    let p = Packed::new(ConvCase { has_init: true, ..ConvCase::new(1, 4, 0, 3) }, &[5, 0, 7]);
    let fwd = h::xla_ssm_causal_conv1d_fwd_cpu as Handler;
    let bwd = h::xla_ssm_causal_conv1d_bwd_cpu as Handler;
    let last = |c: &Call| c.args.len() - 1;
    // cu_seqlens of another dtype, rank or no entry.
    let (mut c, _) = p.calls();
    let i = last(&c);
    c.args[i].dtype = XLA_F32;
    expect_invalid(&c, fwd, &["`cu_seqlens`", "dtype"]);
    let (mut c, _) = p.calls();
    c.args[i].dims = vec![2, 2];
    expect_invalid(&c, fwd, &["`cu_seqlens`", "(num_seqs + 1,)"]);
    let (mut c, _) = p.calls();
    c.args[i] = indices_arr(&[]);
    expect_invalid(&c, fwd, &["`cu_seqlens`", "(num_seqs + 1,)"]);
    // One entry: no sequence, but 12 steps.
    let (mut c, _) = p.calls();
    c.args[i] = indices_arr(&[0]);
    expect_invalid(&c, fwd, &["`cu_seqlens`", "seqlen must be 0"]);
    // Initial states of another number of rows than sequences (forward and backward).
    let (mut c, mut b) = p.calls();
    c.args[i - 1].dims = vec![2, 4, 2];
    expect_invalid(&c, fwd, &["`initial_states`", "(3, 4, 2)", "num_seqs"]);
    let j = b.rets.len() - 1;
    b.rets[j].0.dims = vec![1, 4, 2];
    expect_invalid(&b, bwd, &["`dinitial_states`", "(3, 4, 2)", "num_seqs"]);
    // Batch 2.
    let (mut c, _) = p.calls();
    c.args[0].dims = vec![2, 4, 6];
    c.rets[0].0.dims = vec![2, 4, 6];
    expect_invalid(&c, fwd, &["`cu_seqlens`", "batch 1", "(2, 4, 6)"]);
    // The update takes none: an operand too many.
    let k = ConvCase::new(1, 4, 3, 3);
    let (mut c, _) = conv_update_call(&k, &conv_inputs(&k), None, false, true);
    c.args.push(indices_arr(&[0, 3]));
    c.attrs.push(("has_cu_seqlens", Attr::Bool(true)));
    expect_invalid(&c, h::xla_ssm_causal_conv1d_update_cpu, &["has_cu_seqlens"]);
}

/// The CUDA target against the CPU target on packed problems (longer ones, so that sequences span
/// blocks), then bitwise the same on a second run; boundaries that are not valid must stay inside
/// the buffers (the call succeeds; its results are undefined).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn cuda_matches_cpu() {
    use crate::common::cuda::{gpu, Stream};
    gpu();
    let s = Stream::new();
    let cuda = |h: Handler, c: &Call| crate::ffi_cuda_decode::run(h, c, &s);
    let cpu = |h: Handler, c: &Call| crate::ffi_cpu_decode::run(h, c);
    let mut rng = Rng::new(0xc0da);
    for (i, k) in cases().into_iter().enumerate() {
        let k = ConvCase { dim: [37, 64, 130][i % 3], ..k };
        let lens = lengths(&mut rng, [50, 700, 3000][i % 3]);
        let p = Packed::new(k, &lens);
        let (got, want) = (p.run_packed(&cuda, true), p.run_packed(&cpu, false));
        let exact = tol(p.k.dtype);
        compare("packed conv1d (cuda vs cpu)", &p, &got, &want, exact, sums_tol(p.k.wdtype));
        let again = p.run_packed(&cuda, true);
        for (a, b) in [(&got.dx, &again.dx), (&got.dweight, &again.dweight), (&got.dbias, &again.dbias)] {
            assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "not deterministic\n{:?}", p.cu);
        }
    }
    let p = Packed::new(ConvCase { has_init: true, ..ConvCase::new(1, 40, 0, 4) }, &[30, 0, 1, 50]);
    for cu in [vec![0, 50, 20, 81, 81], vec![-9, 1 << 30, -5, 3, 81], vec![5, 5, 5, 5, 5], vec![81, 0, 0, 0, -1]] {
        let (mut fwd, mut bwd) = p.calls();
        for (c, handler) in [
            (&mut fwd, h::xla_ssm_causal_conv1d_fwd_cuda as Handler),
            (&mut bwd, h::xla_ssm_causal_conv1d_bwd_cuda as Handler),
        ] {
            let i = c.args.len() - 1;
            c.args[i] = indices_arr(&cu);
            cuda(handler, c).unwrap_or_else(|(code, m)| panic!("invalid boundaries {cu:?}: failed ({code}): {m}"));
        }
    }
}
