//! The CUDA launch of the backward scan.

use super::{bwd_workspace_bytes, Bwd};
use crate::error::{Error, Result};
use std::ffi::c_void;

pub(super) fn bwd(bwd: &Bwd, _stream: *mut c_void) -> Result<()> {
    let p = &bwd.params.fwd;
    let needed = bwd_workspace_bytes(p.batch, p.dim, p.seqlen, p.dstate, bwd.groups);
    if needed > 0 && (p.workspace.is_null() || bwd.workspace_bytes < needed) {
        return Err(Error::invalid(format!(
            "selective_scan_bwd: result `workspace`: the CUDA backward needs at least {needed} bytes \
             (xla_ssm_selective_scan_bwd_workspace_bytes), got {}",
            if p.workspace.is_null() { 0 } else { bwd.workspace_bytes }
        )));
    }
    Err(Error::Unimplemented("selective_scan_bwd: CUDA kernel not yet built".into()))
}
