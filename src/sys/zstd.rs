//! The system's Zstandard decoder (`libzstd.so.1`, the reference C library), from our own
//! handle: a compressed fatbinary entry is expanded before its module's globals arrive
//! ([`crate::admit::image`]), on the program's thread, at its first look-up of a kernel.
//! The pure-Rust decoder the image reader carries took about five times as long (PyTorch's
//! first kernel on an H100: +6.7 ms); it remains the fallback where the library is missing,
//! and in a child forked while a load was under way.
//!
//! Loaded at the first frame, never at start-up; threads that race to load it both do
//! (`dlopen` takes a reference, the slots get the same pointers).

use std::ffi::{c_uint, c_void};
use std::sync::atomic::{AtomicPtr, AtomicU8, Ordering};

use crate::sys::driver;

/// `size_t ZSTD_decompress(void *dst, size_t dstCapacity, const void *src, size_t srcSize)`.
type Decompress = unsafe extern "C" fn(*mut c_void, usize, *const c_void, usize) -> usize;
/// `unsigned ZSTD_isError(size_t code)`.
type IsError = unsafe extern "C" fn(usize) -> c_uint;

const UNTRIED: u8 = 0;
const LOADED: u8 = 1;
const MISSING: u8 = 2;
static STATE: AtomicU8 = AtomicU8::new(UNTRIED);
static DECOMPRESS: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static IS_ERROR: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// Expands the Zstandard frames in `packed` into `out`: `Some(Some(n))` with the bytes
/// written (the caller holds them to what it expects), `Some(None)` for input the
/// decoder refuses (malformed, or expanding to more than `out` holds), `None` where the
/// system's decoder is not there.
pub fn decompress(packed: &[u8], out: &mut [u8]) -> Option<Option<usize>> {
    let (decompress, is_error) = functions()?;
    // SAFETY: `out` and `packed` are valid for their lengths, and the decoder writes no
    // more than the capacity it is given (it returns an error instead).
    let n = unsafe {
        decompress(
            out.as_mut_ptr().cast(),
            out.len(),
            packed.as_ptr().cast(),
            packed.len(),
        )
    };
    // SAFETY: a plain function of the returned code.
    let failed = unsafe { is_error(n) } != 0;
    Some((!failed).then_some(n))
}

fn functions() -> Option<(Decompress, IsError)> {
    if STATE.load(Ordering::Acquire) == UNTRIED {
        let loaded = load();
        STATE.store(if loaded { LOADED } else { MISSING }, Ordering::Release);
        crate::sys::log::line(
            crate::config::LogLevel::Debug,
            format_args!(
                "compressed fatbinary entries are expanded by {}",
                if loaded {
                    "the system's libzstd.so.1"
                } else {
                    "the library's own decoder (no libzstd.so.1 to load)"
                }
            ),
        );
    }
    if STATE.load(Ordering::Acquire) != LOADED {
        return None;
    }
    let (d, e) = (
        DECOMPRESS.load(Ordering::Acquire),
        IS_ERROR.load(Ordering::Acquire),
    );
    // SAFETY: `LOADED` is stored (with release) only after both pointers, found non-null
    // under these names in libzstd ([`load`]), whose C signatures the types spell (stable
    // since its 1.0).
    Some(unsafe {
        (
            std::mem::transmute::<*mut c_void, Decompress>(d),
            std::mem::transmute::<*mut c_void, IsError>(e),
        )
    })
}

fn load() -> bool {
    let Some(_loading) = crate::sys::foreign::loading() else {
        return false;
    };
    // SAFETY: dlopen with a NUL-terminated name; a missing library is a null handle.
    let handle =
        unsafe { libc::dlopen(c"libzstd.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return false;
    }
    let d = driver::lookup(handle, c"ZSTD_decompress");
    let e = driver::lookup(handle, c"ZSTD_isError");
    if d.is_null() || e.is_null() {
        return false;
    }
    DECOMPRESS.store(d, Ordering::Release);
    IS_ERROR.store(e, Ordering::Release);
    true
}
