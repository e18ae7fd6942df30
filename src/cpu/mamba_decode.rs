//! `mamba_decode_step` on the CPU: the conv update's outputs, kept in f32 (not rounded to x's
//! dtype), are the state update's x.

use super::{conv1d, state_update};
use crate::ops::conv1d::Conv;
use crate::ops::state_update::Update;

/// Runs a validated step whose states are in place (copied over from the operands when not aliased).
pub(crate) fn step(conv: &Conv, update: &Update) {
    let xc = conv1d::update_values(conv);
    state_update::update_row(update, &xc);
}
