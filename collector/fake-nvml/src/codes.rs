//! NVML return codes (`nvmlReturn_t`) with the values and message texts of the
//! real library, so callers' error mapping is exercised exactly as on a GPU.

use std::ffi::{c_char, CStr};

/// `nvmlReturn_t` is a C enum, i.e. an `unsigned int` on every NVML platform.
pub(crate) type NvmlReturn = u32;

pub(crate) const SUCCESS: NvmlReturn = 0;
pub(crate) const UNINITIALIZED: NvmlReturn = 1;
pub(crate) const INVALID_ARGUMENT: NvmlReturn = 2;
pub(crate) const NOT_SUPPORTED: NvmlReturn = 3;
pub(crate) const NO_PERMISSION: NvmlReturn = 4;
pub(crate) const NOT_FOUND: NvmlReturn = 6;
pub(crate) const INSUFFICIENT_SIZE: NvmlReturn = 7;
pub(crate) const TIMEOUT: NvmlReturn = 10;
pub(crate) const GPU_IS_LOST: NvmlReturn = 15;
/// Returned when a versioned struct carries the wrong `version` field.
pub(crate) const ARGUMENT_VERSION_MISMATCH: NvmlReturn = 25;
pub(crate) const UNKNOWN: NvmlReturn = 999;

/// Text `nvmlErrorString` gives for `code`; codes this fake never returns
/// still get NVML's wording so logs look the same.
pub(crate) fn message(code: NvmlReturn) -> &'static CStr {
    match code {
        SUCCESS => c"Success",
        UNINITIALIZED => c"Uninitialized",
        INVALID_ARGUMENT => c"Invalid Argument",
        NOT_SUPPORTED => c"Not Supported",
        NO_PERMISSION => c"Insufficient Permissions",
        5 => c"Already Initialized",
        NOT_FOUND => c"Not Found",
        INSUFFICIENT_SIZE => c"Insufficient Size",
        8 => c"Insufficient External Power",
        9 => c"Driver Not Loaded",
        TIMEOUT => c"Timeout",
        GPU_IS_LOST => c"GPU is lost",
        ARGUMENT_VERSION_MISMATCH => c"Argument version mismatch",
        _ => c"Unknown Error",
    }
}

/// Pointer form for the C export; the strings are 'static so it never dangles.
pub(crate) fn message_ptr(code: NvmlReturn) -> *const c_char {
    message(code).as_ptr()
}
