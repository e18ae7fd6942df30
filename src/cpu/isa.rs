//! The instruction set, chosen at run time, and the compilation of a worker once per set.
//!
//! The vectorized kernels are generic over the lane count `W` and over `FMA` and compiled three
//! times: AVX-512 (16 lanes), AVX2+FMA (8 lanes) and baseline (8 lanes, no FMA), picked with
//! `is_x86_feature_detected!`. FMA changes rounding a little, never the math.

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Isa {
    /// The best the CPU has. `XLA_SSM_CPU_ISA=avx2|portable` asks for less (to compare them).
    pub(crate) fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let cap = std::env::var("XLA_SSM_CPU_ISA").unwrap_or_default();
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            let avx512 = avx2 && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl");
            match cap.as_str() {
                "portable" => {}
                "avx2" if avx2 => return Isa::Avx2,
                _ if avx512 => return Isa::Avx512,
                _ if avx2 => return Isa::Avx2,
                _ => {}
            }
        }
        Isa::Portable
    }

    pub(crate) fn lanes(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => 16,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => 8,
            Isa::Portable => 8,
        }
    }
}

/// `isa_workers!(body(arg: Type, ...))` defines `fn worker(isa: Isa, arg: Type, ...)`, which runs
/// `body::<W, FMA>(arg, ...)` (an `#[inline(always)]` loop over the work) compiled for that
/// instruction set: `#[target_feature]` applies to a function's own body, so everything the body
/// inlines gets the set's instructions. Each set's copy lives in a module of its own because rustc
/// makes one codegen unit per module: the copies (fully inlined, large) are then optimized in
/// parallel. In one module they were one unit, compiled on one core.
macro_rules! isa_workers {
    ($body:ident($($arg:ident: $ty:ty),* $(,)?)) => {
        fn worker(isa: $crate::cpu::isa::Isa, $($arg: $ty),*) {
            use $crate::cpu::isa::Isa;
            // SAFETY (both unsafe calls): `Isa::detect` saw the features these functions are compiled for.
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => unsafe { avx512::worker($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { avx2::worker($($arg),*) },
                Isa::Portable => portable::worker($($arg),*),
            }
        }

        #[cfg(target_arch = "x86_64")]
        mod avx512 {
            use super::*;
            #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
            pub(super) fn worker($($arg: $ty),*) {
                $body::<16, true>($($arg),*)
            }
        }

        #[cfg(target_arch = "x86_64")]
        mod avx2 {
            use super::*;
            #[target_feature(enable = "avx2,fma")]
            pub(super) fn worker($($arg: $ty),*) {
                $body::<8, true>($($arg),*)
            }
        }

        mod portable {
            use super::*;
            pub(super) fn worker($($arg: $ty),*) {
                $body::<8, false>($($arg),*)
            }
        }
    };
}
pub(crate) use isa_workers;

/// `isa_fns! { fn name(arg: Type, ...) = body; ... }` defines, for each, `fn name<const W: usize,
/// const FMA: bool>(arg: Type, ...)`, which calls `body::<W, FMA>(arg, ...)` compiled once per
/// instruction set in functions of their own (not inlined): the piece is then compiled once per set,
/// however many places of the workers call it, and apart from them (large functions cost LLVM more
/// than their size). `W` and `FMA` pick the set, as the workers' do ([`isa_workers!`]); the argument
/// types must not depend on them (lane arrays travel flattened, `as_flattened`, and are re-chunked
/// in the body).
macro_rules! isa_fns {
    ($($(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) = $body:ident;)*) => {
        $(
            $(#[$attr])*
            #[inline(always)]
            $vis fn $name<const W: usize, const FMA: bool>($($arg: $ty),*) {
                // SAFETY (both unsafe calls): 16 lanes are compiled only into the AVX-512 workers and
                // 8 lanes with FMA only into the AVX2 ones, which run only where `Isa::detect` saw
                // the features these functions are compiled for.
                #[cfg(target_arch = "x86_64")]
                if W == 16 {
                    return unsafe { isa_fns_avx512::$name($($arg),*) };
                } else if FMA {
                    return unsafe { isa_fns_avx2::$name($($arg),*) };
                }
                isa_fns_portable::$name($($arg),*)
            }
        )*

        #[cfg(target_arch = "x86_64")]
        mod isa_fns_avx512 {
            use super::*;
            $(
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                #[inline(never)]
                pub(super) fn $name($($arg: $ty),*) {
                    $body::<16, true>($($arg),*)
                }
            )*
        }

        #[cfg(target_arch = "x86_64")]
        mod isa_fns_avx2 {
            use super::*;
            $(
                #[target_feature(enable = "avx2,fma")]
                #[inline(never)]
                pub(super) fn $name($($arg: $ty),*) {
                    $body::<8, true>($($arg),*)
                }
            )*
        }

        mod isa_fns_portable {
            use super::*;
            $(
                #[inline(never)]
                pub(super) fn $name($($arg: $ty),*) {
                    $body::<8, false>($($arg),*)
                }
            )*
        }
    };
}
pub(crate) use isa_fns;
