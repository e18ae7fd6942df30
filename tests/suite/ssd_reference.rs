//! Checks of the SSD references themselves (tests/suite/ssd_common), so that the round-trip tests compare
//! against something known to be right: the plain recurrence and the chunked attention form agree
//! (outputs, final states, chunk-entering states) over chunk sizes, odd sequence lengths and groups;
//! a closed form; and the reference backward against finite differences of the reference forward.

// Index loops read like the math here.
#![allow(clippy::needless_range_loop)]

use crate::ssd_common::*;

fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().chain(b).fold(0f64, |m, x| m.max(x.abs())).max(1e-300);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn recurrence_and_chunked_form_agree() {
    let mut n = 0;
    for (chunk_size, seqlen) in [(32, 1), (32, 31), (32, 97), (64, 64), (64, 130), (128, 129), (256, 300), (256, 17)] {
        for (heads, groups) in [(4, 1), (4, 2), (4, 4)] {
            for (limit, softplus) in [((0.0, f32::INFINITY), true), (CLAMP, true), (CLAMP, false)] {
                let case = SsdCase {
                    chunk_size,
                    groups,
                    dt_limit: limit,
                    softplus,
                    seed: n,
                    d: if n % 2 == 0 { DForm::PerHead } else { DForm::PerChannel },
                    ..SsdCase::new(2, seqlen, heads, 3, 5).all_optional()
                };
                let p = SsdProblem::random(&case, false);
                let i = p.in64();
                let (r, c) = (reference_recurrence(&case, &i), reference_chunked(&case, &i));
                assert!(max_rel_diff(&r.y, &c.y) < 1e-11, "y: {case:?}");
                assert!(max_rel_diff(&r.final_states, &c.final_states) < 1e-11, "final_states: {case:?}");
                assert!(max_rel_diff(&r.chunk_states, &c.chunk_states) < 1e-11, "chunk_states: {case:?}");
                // The chunk states are the states entering each chunk: chunk 0 holds h0.
                let h0 = p.h0.as_ref().unwrap();
                for b in 0..case.batch {
                    for h in 0..case.heads {
                        for pp in 0..case.headdim {
                            for s in 0..case.dstate {
                                assert_eq!(r.chunk_states[case.ci(b, h, pp, 0, s)], h0[case.si(b, h, pp, s)] as f64);
                            }
                        }
                    }
                }
                n += 1;
            }
        }
    }
}

/// A = 0, no softplus, headdim = dstate = 1, no options: the state never decays, so
/// y_t = C_t * sum_{s <= t} dt_s B_s x_s, computed here as an explicit double sum.
#[test]
fn no_decay_is_a_cumulative_sum() {
    let case = SsdCase { softplus: false, groups: 2, chunk_size: 32, ..SsdCase::new(2, 45, 4, 1, 1) };
    let mut p = SsdProblem::random(&case, false);
    p.a.iter_mut().for_each(|a| *a = 0.0);
    let i = p.in64();
    for r in [reference_recurrence(&case, &i), reference_chunked(&case, &i)] {
        for b in 0..case.batch {
            for h in 0..case.heads {
                let g = case.group(h);
                let term = |s: usize| {
                    p.dt[case.dti(b, s, h)] as f64 * p.b[case.bci(b, s, g, 0)] as f64 * p.x[case.xi(b, s, h, 0)] as f64
                };
                for t in 0..case.seqlen {
                    let want = p.c[case.bci(b, t, g, 0)] as f64 * (0..=t).map(term).sum::<f64>();
                    let got = r.y[case.xi(b, t, h, 0)];
                    assert!((got - want).abs() <= 1e-12 * want.abs().max(1.0), "b {b} h {h} t {t}: {got} vs {want}");
                }
            }
        }
    }
}

fn loss(case: &SsdCase, i: &In64, dy: &[f64], dfinal: Option<&[f64]>) -> f64 {
    let r = reference_recurrence(case, i);
    let mut l: f64 = r.y.iter().zip(dy).map(|(a, b)| a * b).sum();
    if let Some(v) = dfinal {
        l += r.final_states.iter().zip(v).map(|(a, b)| a * b).sum::<f64>();
    }
    l
}

/// The reference backward against central differences of the reference forward's loss, at every
/// element of every input, on small problems covering each option, with and without the clamp.
#[test]
fn backward_matches_finite_differences() {
    let cases = [
        SsdCase { groups: 2, d: DForm::PerChannel, dt_limit: CLAMP, ..SsdCase::new(1, 37, 2, 2, 3).all_optional() },
        SsdCase { softplus: false, dt_limit: NO_CLAMP, ..SsdCase::new(2, 6, 2, 3, 2).all_optional() },
        SsdCase { softplus: false, dt_limit: CLAMP, d: DForm::PerHead, has_z: true, ..SsdCase::new(1, 9, 3, 2, 2) },
        SsdCase {
            dt_limit: (0.0, f32::INFINITY),
            chunk_size: 32,
            groups: 3,
            ..SsdCase::new(1, 5, 3, 1, 4).all_optional()
        },
    ];
    for (k, case) in cases.iter().enumerate() {
        let case = SsdCase { seed: 11 + k as u64, ..case.clone() };
        let p = SsdProblem::random(&case, true);
        let i = p.in64();
        let dy: Vec<f64> = p.dy.iter().map(|&v| v as f64).collect();
        let dfinal: Vec<f64> = p.dfinal.as_ref().unwrap().iter().map(|&v| v as f64).collect();
        let g = reference_bwd(&case, &i, &dy, Some(&dfinal));
        let eps = 1e-6;
        type Field = fn(&mut In64) -> Option<&mut Vec<f64>>;
        let fields: [(&str, Field, Option<&Vec<f64>>); 9] = [
            ("x", |i| Some(&mut i.x), Some(&g.dx)),
            ("dt", |i| Some(&mut i.dt), Some(&g.ddt)),
            ("A", |i| Some(&mut i.a), Some(&g.da)),
            ("B", |i| Some(&mut i.b), Some(&g.db)),
            ("C", |i| Some(&mut i.c), Some(&g.dc)),
            ("D", |i| i.d.as_mut(), g.dd.as_ref()),
            ("z", |i| i.z.as_mut(), g.dz.as_ref()),
            ("dt_bias", |i| i.dt_bias.as_mut(), g.ddt_bias.as_ref()),
            ("initial_states", |i| i.h0.as_mut(), g.dh0.as_ref()),
        ];
        let mut checked = 0;
        for (name, field, grad) in fields {
            let mut probe = i.clone();
            let Some(len) = field(&mut probe).map(|v| v.len()) else {
                assert!(grad.is_none(), "{name}: a gradient for an absent input");
                continue;
            };
            let grad = grad.unwrap_or_else(|| panic!("{name}: no gradient"));
            assert_eq!(grad.len(), len, "{name}: gradient length");
            for e in 0..len {
                let at = |delta: f64| {
                    let mut j = i.clone();
                    field(&mut j).unwrap()[e] += delta;
                    loss(&case, &j, &dy, Some(&dfinal))
                };
                let fd = (at(eps) - at(-eps)) / (2.0 * eps);
                let tol = 1e-6 * (1.0 + grad[e].abs());
                assert!(
                    (fd - grad[e]).abs() <= tol,
                    "{name}[{e}]: reference {}, finite difference {fd}; case {case:?}",
                    grad[e]
                );
                checked += 1;
            }
        }
        assert!(checked > 100, "too few elements checked: {checked}");
    }
}

/// The clamp really clamps in the cases above (else its gradient path went untested): some dt of
/// the default range fall outside CLAMP, and their ddt is zero.
#[test]
fn clamped_steps_have_no_dt_gradient() {
    let case = SsdCase { dt_limit: CLAMP, ..SsdCase::new(1, 40, 2, 2, 2).all_optional() };
    let p = SsdProblem::random(&case, false);
    let i = p.in64();
    let g = p.reference_bwd();
    let (mut clamped, mut free) = (0, 0);
    for t in 0..case.seqlen {
        for h in 0..case.heads {
            let (v, d) = dt_eff(&case, &i, 0, t, h);
            if v == CLAMP.0 as f64 || v == CLAMP.1 as f64 {
                clamped += 1;
                assert_eq!(d, 0.0);
                assert_eq!(g.ddt[case.dti(0, t, h)], 0.0);
            } else {
                free += 1;
                assert!(g.ddt[case.dti(0, t, h)] != 0.0);
            }
        }
    }
    assert!(clamped >= 10 && free >= 10, "clamped {clamped}, free {free}");
}
