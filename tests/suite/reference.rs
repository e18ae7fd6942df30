//! Checks of the f64 reference itself (closed forms, symmetries, continuation), so that the
//! round-trip tests compare against something known to be right.

// Index loops read like the math here.
#![allow(clippy::needless_range_loop)]

use crate::common::*;

/// Sets every entry of `v` to `x`.
fn fill(v: &mut [f32], x: f32) {
    v.iter_mut().for_each(|e| *e = x);
}

fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    let scale = a.iter().chain(b).fold(0f64, |m, x| m.max(x.abs())).max(1e-300);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// dstate = 1, A = 0, no softplus: h[l] = h0 + sum_{j<=l} dt[j] B[j] u[j] (no decay), so
/// y[l] = C[l] * (h0 + that sum) + D u[l], computed here as an explicit double sum.
#[test]
fn no_decay_is_a_cumulative_sum() {
    for (layout, groups) in [(Layout::Bdl, 1), (Layout::Bld, 2), (Layout::Bdl, 0), (Layout::Bld, 4)] {
        let case = Case {
            layout,
            groups,
            softplus: false,
            has_d: true,
            has_initial_state: true,
            has_delta_bias: true,
            ..Case::new(2, 4, 23, 1)
        };
        let mut p = Problem::random(&case);
        fill(&mut p.a, 0.0);
        let r = p.reference();
        let (bias, dskip, h0) =
            (p.delta_bias.as_ref().unwrap(), p.d.as_ref().unwrap(), p.initial_state.as_ref().unwrap());
        let mut want = vec![0f64; case.x_len()];
        let mut want_state = vec![0f64; case.state_len()];
        for b in 0..case.batch {
            for d in 0..case.dim {
                let h_init = h0[b * case.dim + d] as f64;
                let term = |j: usize| {
                    let xi = case.x_index(b, d, j);
                    (p.delta[xi] as f64 + bias[d] as f64) * p.b[case.bc_index(b, d, 0, j)] as f64 * p.u[xi] as f64
                };
                for l in 0..case.seqlen {
                    let sum: f64 = (0..=l).map(term).sum();
                    let xi = case.x_index(b, d, l);
                    want[xi] =
                        p.c[case.bc_index(b, d, 0, l)] as f64 * (h_init + sum) + dskip[d] as f64 * p.u[xi] as f64;
                }
                want_state[b * case.dim + d] = h_init + (0..case.seqlen).map(term).sum::<f64>();
            }
        }
        assert!(max_rel_diff(&r.out, &want) < 1e-12, "{layout:?} groups {groups}: out");
        assert!(max_rel_diff(&r.final_state, &want_state) < 1e-12, "{layout:?} groups {groups}: state");
    }
}

/// Constant dt, A, B, u and no h0: h[l] = dt B u (1 - r^(l+1)) / (1 - r) with r = exp(dt A).
#[test]
fn constant_inputs_give_a_geometric_series() {
    let case = Case { groups: 0, softplus: false, ..Case::new(1, 3, 40, 2) };
    let mut p = Problem::random(&case);
    let (dt, bv, uv) = (0.25f32, 0.75f32, 1.5f32);
    fill(&mut p.delta, dt);
    fill(&mut p.b, bv);
    fill(&mut p.u, uv);
    let r = p.reference();
    for d in 0..case.dim {
        for l in 0..case.seqlen {
            let mut y = 0.0;
            for n in 0..case.dstate {
                let ratio = (dt as f64 * p.a[d * case.dstate + n] as f64).exp();
                let h = dt as f64 * bv as f64 * uv as f64 * (1.0 - ratio.powi(l as i32 + 1)) / (1.0 - ratio);
                y += p.c[d * case.dstate + n] as f64 * h;
                if l + 1 == case.seqlen {
                    let got = r.final_state[d * case.dstate + n];
                    assert!((got - h).abs() <= 1e-12 * h.abs(), "state d={d} n={n}: {got} vs {h}");
                }
            }
            let got = r.out[case.x_index(0, d, l)];
            assert!((got - y).abs() <= 1e-12 * y.abs().max(1.0), "out d={d} l={l}: {got} vs {y}");
        }
    }
}

/// softplus on delta equals feeding softplus(delta) with softplus off; z multiplies by silu(z).
#[test]
fn softplus_and_gate() {
    let case = Case { has_z: true, has_delta_bias: true, ..Case::new(2, 3, 17, 4) };
    let p = Problem::random(&case);
    let r = p.reference();
    let mut q = p.clone();
    q.case.softplus = false;
    q.case.has_z = false;
    q.z = None;
    let bias = p.delta_bias.as_ref().unwrap();
    for b in 0..case.batch {
        for d in 0..case.dim {
            for l in 0..case.seqlen {
                let xi = case.x_index(b, d, l);
                let x = p.delta[xi] as f64 + bias[d] as f64;
                q.delta[xi] = ((x.exp().ln_1p()) - bias[d] as f64) as f32;
            }
        }
    }
    let rq = q.reference();
    let z = p.z.as_ref().unwrap();
    let gated: Vec<f64> = rq.out.iter().zip(z).map(|(y, &z)| y * (z as f64 / (1.0 + (-(z as f64)).exp()))).collect();
    // q's delta went through f32, hence 1e-6 and not 1e-12.
    assert!(max_rel_diff(&r.out, &gated) < 1e-6, "{}", max_rel_diff(&r.out, &gated));
    assert!(max_rel_diff(&r.final_state, &rq.final_state) < 1e-6);
    // And the draws are what they claim: dt = softplus(delta + bias) within 0.01..1.
    for b in 0..case.batch {
        for d in 0..case.dim {
            for l in 0..case.seqlen {
                let x = p.delta[case.x_index(b, d, l)] as f64 + bias[d] as f64;
                let dt = x.exp().ln_1p();
                assert!((0.009..=1.01).contains(&dt), "dt = {dt}");
            }
        }
    }
}

/// The same problem in layout "bld" gives the transposed result, bit for bit.
#[test]
fn layouts_agree() {
    let case = Case { groups: 2, ..Case::new(2, 6, 11, 5).all_optional() };
    let p = Problem::random(&case);
    let case_t = Case { layout: Layout::Bld, ..case.clone() };
    let mut t = p.clone();
    t.case = case_t.clone();
    for b in 0..case.batch {
        for d in 0..case.dim {
            for l in 0..case.seqlen {
                let (from, to) = (case.x_index(b, d, l), case_t.x_index(b, d, l));
                t.u[to] = p.u[from];
                t.delta[to] = p.delta[from];
                t.z.as_mut().unwrap()[to] = p.z.as_ref().unwrap()[from];
                for n in 0..case.dstate {
                    let (from, to) = (case.bc_index(b, d, n, l), case_t.bc_index(b, d, n, l));
                    t.b[to] = p.b[from];
                    t.c[to] = p.c[from];
                }
            }
        }
    }
    let (r, rt) = (p.reference(), t.reference());
    for b in 0..case.batch {
        for d in 0..case.dim {
            for l in 0..case.seqlen {
                assert_eq!(r.out[case.x_index(b, d, l)], rt.out[case_t.x_index(b, d, l)]);
            }
        }
    }
    assert_eq!(r.final_state, rt.final_state);
}

/// groups = dim with B, C constant in time and batch equals the time-invariant form.
#[test]
fn time_invariant_equals_constant_per_channel_groups() {
    for layout in [Layout::Bdl, Layout::Bld] {
        let case = Case { groups: 0, layout, ..Case::new(2, 4, 9, 3).all_optional() };
        let p = Problem::random(&case);
        let case_g = Case { groups: case.dim, ..case.clone() };
        let mut g = p.clone();
        g.case = case_g.clone();
        g.b = vec![0.0; case_g.bc_len()];
        g.c = vec![0.0; case_g.bc_len()];
        for b in 0..case.batch {
            for d in 0..case.dim {
                for n in 0..case.dstate {
                    for l in 0..case.seqlen {
                        g.b[case_g.bc_index(b, d, n, l)] = p.b[d * case.dstate + n];
                        g.c[case_g.bc_index(b, d, n, l)] = p.c[d * case.dstate + n];
                    }
                }
            }
        }
        let (r, rg) = (p.reference(), g.reference());
        assert_eq!(r.out, rg.out, "{layout:?}");
        assert_eq!(r.final_state, rg.final_state, "{layout:?}");
    }
}

/// Scanning [0, L) equals scanning [0, k) then [k, L) from the first part's final state.
#[test]
fn continuation_reference() {
    for (layout, groups, has_h0) in [(Layout::Bdl, 2, true), (Layout::Bld, 1, false), (Layout::Bdl, 0, true)] {
        let case =
            Case { layout, groups, has_initial_state: has_h0, has_d: true, has_z: true, ..Case::new(2, 4, 37, 6) };
        let p = Problem::random(&case);
        let full = p.reference();
        for k in [0, 1, 16, 36, 37] {
            let first = p.slice_seq(0, k, p.initial_state.clone());
            let r1 = first.reference();
            let h_mid: Vec<f32> = r1.final_state.iter().map(|&x| x as f32).collect();
            let r2 = p.slice_seq(k, case.seqlen, Some(h_mid)).reference();
            let mut joined = vec![0f64; case.x_len()];
            let (c1, c2) = (&first.case, Case { seqlen: case.seqlen - k, ..case.clone() });
            for b in 0..case.batch {
                for d in 0..case.dim {
                    for l in 0..case.seqlen {
                        joined[case.x_index(b, d, l)] =
                            if l < k { r1.out[c1.x_index(b, d, l)] } else { r2.out[c2.x_index(b, d, l - k)] };
                    }
                }
            }
            // The hand-over goes through f32, hence 1e-6.
            assert!(max_rel_diff(&joined, &full.out) < 1e-6, "{layout:?} k={k}: out");
            assert!(max_rel_diff(&r2.final_state, &full.final_state) < 1e-6, "{layout:?} k={k}: state");
        }
    }
}

/// The same continuation through the CPU handler (real call frames).
#[test]
fn continuation_cpu_handler() {
    for (dtype, layout, groups) in [(Dt::F32, Layout::Bdl, 2), (Dt::BF16, Layout::Bld, 1), (Dt::F16, Layout::Bdl, 0)] {
        let case = Case { dtype, bc_dtype: dtype, layout, groups, ..Case::new(2, 8, 50, 16).all_optional() };
        let p = Problem::random(&case);
        let (out, state) = run_cpu(&p).unwrap();
        for k in [0, 1, 25, 49, 50] {
            let first = p.slice_seq(0, k, p.initial_state.clone());
            let (out1, state1) = run_cpu(&first).unwrap();
            let second = p.slice_seq(k, case.seqlen, Some(state1));
            let (out2, state2) = run_cpu(&second).unwrap();
            let mut joined = vec![0f32; case.x_len()];
            for b in 0..case.batch {
                for d in 0..case.dim {
                    for l in 0..case.seqlen {
                        joined[case.x_index(b, d, l)] = if l < k {
                            out1[first.case.x_index(b, d, l)]
                        } else {
                            out2[second.case.x_index(b, d, l - k)]
                        };
                    }
                }
            }
            let want_out: Vec<f64> = out.iter().map(|&x| x as f64).collect();
            let want_state: Vec<f64> = state.iter().map(|&x| x as f64).collect();
            // Both runs round the same f32 values to the output dtype: f32-level agreement.
            let tol = Tol { rel_l2: 1e-6, rel_max: 1e-5 };
            assert_close(&format!("joined out, k={k}"), &case, &joined, &want_out, tol);
            assert_close(&format!("final_state, k={k}"), &case, &state2, &want_state, tol);
        }
    }
}

/// The comparison itself: NaN never passes, an error beyond the bound fails, within passes.
#[test]
fn comparison_rejects_nan_and_large_errors() {
    let want = [1.0f64, -2.0, 3.0];
    assert!(std::panic::catch_unwind(|| assert_close("t", &"nan", &[1.0, f32::NAN, 3.0], &want, Tol::BF16)).is_err());
    assert!(
        std::panic::catch_unwind(|| assert_close("t", &"inf", &[1.0, f32::INFINITY, 3.0], &want, Tol::BF16)).is_err()
    );
    assert!(std::panic::catch_unwind(|| assert_close("t", &"off", &[1.0, -2.0, 3.001], &want, Tol::F32)).is_err());
    assert_close("t", &"ok", &[1.0, -2.0, 3.00001], &want, Tol::F32);
    assert_close("t", &"empty", &[], &[], Tol::F32);
}

/// The generator is deterministic and rounds inputs to their dtypes.
#[test]
fn generator_is_deterministic_and_rounded() {
    let case = Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(1, 4, 8, 4).all_optional() };
    let (p, q) = (Problem::random(&case), Problem::random(&case));
    assert_eq!(p.u, q.u);
    assert_eq!(p.b, q.b);
    for x in p.u.iter().chain(&p.delta).chain(&p.b).chain(&p.c).chain(p.z.as_ref().unwrap()) {
        assert_eq!(*x, Dt::BF16.round(*x));
    }
    let other = Problem::random(&Case { seed: 2, ..case });
    assert_ne!(p.u, other.u);
}
