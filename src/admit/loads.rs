//! Device memory that no allocation call names but a call we see causes: a module's or
//! library's globals and code, and the context's limits (its per-thread stack, the device
//! `malloc` heap, the `printf` FIFO).
//!
//! Measured on the H200 (scripts/gpu/footprint_probe.sh, CUDA 13, driver 580):
//! - `cuModuleLoad*` allocates a module's globals at the load, lazy loading or not;
//! - `cuLibraryLoad*` with lazy loading (the default) allocates nothing at the load: the
//!   globals arrive at the library's first look-up (`cuLibraryGetGlobal`, and the other
//!   `cuLibraryGet*`), with eager loading at the load;
//! - `cuCtxSetLimit(STACK_SIZE)` allocates at once (64 KiB a thread: 16.2 GiB);
//!   `MALLOC_HEAP_SIZE` and `PRINTF_FIFO_SIZE` allocate at the next launch of a kernel
//!   that uses them (a 2 GiB heap: 2050 MiB), after which the heap cannot change.
//!
//! So a load is admitted before the driver's call for what its image says it places on
//! the device ([`crate::admit::image`]: the cubin's global and constant sections for the
//! device's architecture, and its code where modules load eagerly; PTX's declared
//! globals), and a load that does not fit is refused before the driver holds any of it.
//! The image is read as the driver reads it: from the caller's memory through
//! `process_vm_readv` (an unmapped address is a failed read, never a fault), or from the
//! file, if it is a regular one; a compressed fatbinary entry is expanded first. A lazily
//! loaded library's image is admitted at its first look-up. cudart loads every fatbinary
//! of a process this way at start-up, most never used, so an image that the program
//! carries in a read-only segment of its own (or of a shared library: it cannot change
//! while that is loaded) is read only at that look-up; reading each at its load cost some
//! 15 µs apiece (17 reads of a ten-entry fatbinary, each a system call). Any other image
//! is read at its load, and where its entry is compressed, it is expanded only at the
//! look-up, read again from the caller's memory then (expanding all of a framework's could
//! cost its start-up seconds). The load or
//! look-up is then measured: the device's free memory before and after (`cuMemGetInfo`, a
//! microsecond against the milliseconds of a load), and what it grew by beyond the image's
//! figure is admitted too (the charge is the larger of the two). Where the image cannot
//! say (a format it does not know, a compressed entry that does not expand), the
//! measurement alone decides, after the call: a load whose growth does not fit is undone
//! (the module unloaded) and returns `CUDA_ERROR_OUT_OF_MEMORY`; a look-up cannot be
//! undone, so its growth stays charged and the look-up returns `CUDA_ERROR_OUT_OF_MEMORY`
//! (the memory goes with the library's unload). What a module or library holds is kept
//! against its handle and given back at its unload.
//!
//! Limits are never measured. The driver accepts `cuCtxSetLimit` from any thread, and a
//! reading of the device's free memory around the call counts whatever another thread
//! allocates or frees meanwhile as the limit's: charged to the limit, that would stay in
//! the books after everything was freed. A limit is charged by what it costs instead:
//! the heap and the FIFO their value above the one they had when first seen (the
//! driver's default; they are allocated at the next launch), the stack its value above
//! that times the device's resident threads (multiprocessors × threads per
//! multiprocessor: on the H200, 63 KiB × 132 × 2048 is the 16.2 GiB measured for 64
//! KiB). The charge is admitted before the driver is asked (a limit that does not fit is
//! never set), and a smaller limit gives back exactly what the larger one was charged
//! (a context's destruction gives back all its limits were). The change is made whole
//! under one lock — the old value's reading, the admission, the driver's call and the
//! settling — so that two threads setting a limit at once never both start from the same
//! old value (one would give back what the other then never charges). The lock is taken
//! only here: no allocation waits on it. Where the figure is off (a driver that rounds
//! the stack otherwise, or allocates the heap at once), the footprint re-read corrects
//! it where NVML sees the process.
//!
//! The loads' reading is device-wide: another thread's or process's allocation during a
//! load is counted with it (an over-charge until the unload), a free during a load hides
//! part of it (an under-charge that the footprint re-read corrects where NVML can see the
//! process). Kernels that lazy loading brings in at their first launch, and local memory
//! a spilling kernel grows at its launch, are not seen by any call: the footprint re-read
//! charges them (within a second, where NVML sees the process).

use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use crate::admit::image::{self, Arch, Footprint, Placed, Source, Unknown};
use crate::admit::{Fixed, admit};
use crate::books::ledger::{DeviceLedger, MAX_DEVICES, Reservation, clamp_i64};
use crate::config::LogLevel;
use crate::runtime::{Cx, DeviceCx};
use crate::sys::driver::{Context, CuResult, Library, Opaque, real};
use crate::sys::lock::Lock;
use crate::tell::report::Bytes;

/// `CU_LIMIT_STACK_SIZE`; `CU_LIMIT_PRINTF_FIFO_SIZE` is 1, `CU_LIMIT_MALLOC_HEAP_SIZE` 2.
const LIMIT_STACK_SIZE: i32 = 0;

/// A module or library and what it holds on its device.
struct Load {
    handle: usize,
    device: usize,
    bytes: u64,
    /// The device's books when it was charged: a clear (the context went away, and the
    /// module with it) voids it.
    books: u64,
    /// Its globals are on the device: later look-ups cost nothing and are not measured.
    resident: bool,
    /// What its image says its first look-up brings (a lazily loaded library).
    pending: u64,
    /// Where its image is in the caller's memory, when it is read at its first look-up
    /// (an image the program carries read-only, or a compressed entry, to be expanded
    /// then; 0: `pending` says it all).
    later: usize,
    /// The context it was loaded in, which takes it along when destroyed (0: unknown).
    context: usize,
}

static LOADS: Lock<Vec<Load>> = Lock::new(Vec::new());

/// Keeps what `handle` holds on `device` (charged in `d`'s current books) until it goes.
fn remember(handle: impl Opaque, device: usize, d: &DeviceLedger, bytes: u64, resident: bool) {
    remember_pending(handle, device, d, bytes, resident, (0, 0));
}

/// As [`remember`], with what the first look-up brings: `(bytes, later)` (see [`Load`]).
fn remember_pending(
    handle: impl Opaque,
    device: usize,
    d: &DeviceLedger,
    bytes: u64,
    resident: bool,
    (pending, later): (u64, usize),
) {
    if !resident {
        LAZY.fetch_add(1, Ordering::AcqRel);
    }
    let mut context = Context::NULL;
    // SAFETY: a valid out-pointer.
    if !unsafe { real::cuCtxGetCurrent(&mut context) }.is_ok() {
        context = Context::NULL;
    }
    LOADS.lock().push(Load {
        handle: handle.key(),
        device,
        bytes,
        books: d.books_epoch(),
        resident,
        pending,
        later,
        context: context.key(),
    });
}

/// Where the image of a load is: in the caller's memory (as the driver reads it, from a
/// pointer and its own headers), or in a file.
#[derive(Clone, Copy)]
pub enum Image {
    Memory(*const c_void),
    File(*const c_char),
}

/// The caller's memory from `base`, read with `process_vm_readv` on ourselves: an
/// address that is not mapped is a failed read, never a fault.
struct Memory(usize);

impl Source for Memory {
    fn read(&self, at: u64, buf: &mut [u8]) -> bool {
        let Some(from) = usize::try_from(at)
            .ok()
            .and_then(|at| self.0.checked_add(at))
            .filter(|from| from.checked_add(buf.len()).is_some())
        else {
            return false;
        };
        if buf.is_empty() {
            return true;
        }
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let remote = libc::iovec {
            iov_base: from as *mut c_void,
            iov_len: buf.len(),
        };
        // SAFETY: `local` is our own buffer of that length; the remote range is only
        // read by the kernel, which answers EFAULT where it is not mapped.
        let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
        n == buf.len() as isize
    }
}

/// A regular file, read where asked.
struct File(std::fs::File);

impl Source for File {
    fn read(&self, at: u64, buf: &mut [u8]) -> bool {
        std::os::unix::fs::FileExt::read_exact_at(&self.0, buf, at).is_ok()
    }
}

/// What `image` says its load places on `device` (`Err`: it cannot say, and why, told at
/// debug level; `None` where there is no image or device to ask about): its data, and its
/// code too where modules load eagerly (with lazy loading a kernel's code arrives at its
/// first use, which no call here sees). `expand`: a compressed entry is expanded (else it
/// cannot say, [`Unknown::Unexpanded`]).
fn predicted(
    call: &str,
    image: Image,
    device: usize,
    expand: bool,
) -> Result<u64, Option<Unknown>> {
    let placed = placed(call, image, device, expand)?;
    let bytes = if lazy_loading() {
        placed.data
    } else {
        placed.data.saturating_add(placed.code)
    };
    crate::sys::log::line(
        LogLevel::Debug,
        format_args!(
            "{call}: the image places {} of data and {} of code on the device",
            Bytes(placed.data),
            Bytes(placed.code)
        ),
    );
    Ok(bytes)
}

fn placed(
    call: &str,
    image: Image,
    device: usize,
    expand: bool,
) -> Result<Placed, Option<Unknown>> {
    let arch = arch(device).ok_or(None)?;
    let footprint = |src: &dyn Source| {
        if expand {
            image::footprint(src, arch)
        } else {
            image::footprint_unexpanded(src, arch)
        }
    };
    let said = match image {
        Image::Memory(p) if !p.is_null() => {
            let memory = Memory(p as usize);
            match image::wrapped(&memory) {
                Some(fatbin) => footprint(&Memory(fatbin as usize)),
                None => footprint(&memory),
            }
        }
        Image::File(path) if !path.is_null() => match open_regular(path) {
            Some(file) => footprint(&File(file)),
            None => return Err(None),
        },
        _ => return Err(None),
    };
    match said {
        Footprint::Placed(placed) => Ok(placed),
        Footprint::Unknown(Unknown::Unexpanded) => {
            crate::sys::log::line(
                LogLevel::Debug,
                format_args!("{call}: the image's entry is compressed: read at the first look-up"),
            );
            Err(Some(Unknown::Unexpanded))
        }
        Footprint::Unknown(why) => {
            crate::sys::log::line(
                LogLevel::Debug,
                format_args!(
                    "{call}: the image cannot say what it places on the device ({why:?}): \
                     measured at the load"
                ),
            );
            Err(Some(why))
        }
    }
}

/// The file at `path` if it is a regular one (a FIFO read here would take the driver's
/// bytes), opened without waiting.
fn open_regular(path: *const c_char) -> Option<std::fs::File> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::OpenOptionsExt;
    // SAFETY: the caller's NUL-terminated path (the driver takes it too).
    let path = unsafe { std::ffi::CStr::from_ptr(path) };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(std::ffi::OsStr::from_bytes(path.to_bytes()))
        .ok()?;
    file.metadata().ok()?.is_file().then_some(file)
}

/// The compute capability of `device`, asked of the driver once.
fn arch(device: usize) -> Option<Arch> {
    static ARCH: [AtomicU32; MAX_DEVICES] = [const { AtomicU32::new(0) }; MAX_DEVICES];
    let known = ARCH.get(device)?;
    let seen = known.load(Ordering::Relaxed);
    if seen != 0 {
        return Some(Arch(seen));
    }
    /// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR`, `…_MINOR`.
    const MAJOR: i32 = 75;
    const MINOR: i32 = 76;
    let (major, minor) = attributes(device, MAJOR, MINOR)?;
    let arch = Arch::new(major, minor);
    (arch.0 > 0).then(|| {
        known.store(arch.0, Ordering::Relaxed);
        arch
    })
}

/// Two attributes of `device`, from the driver (`None`: it did not say, or said a
/// negative number).
fn attributes(device: usize, a: i32, b: i32) -> Option<(u32, u32)> {
    let (mut handle, mut first, mut second) = (0, 0, 0);
    // SAFETY: valid out-pointers; a device ordinal the driver checks.
    let ok = unsafe {
        real::cuDeviceGet(&mut handle, i32::try_from(device).ok()?).is_ok()
            && real::cuDeviceGetAttribute(&mut first, a, handle).is_ok()
            && real::cuDeviceGetAttribute(&mut second, b, handle).is_ok()
    };
    ok.then_some((u32::try_from(first).ok()?, u32::try_from(second).ok()?))
}

/// Reserves what the image says, before the driver's call: `Err` is the refusal.
fn admit_predicted(
    call: &str,
    dev: &DeviceCx,
    predicted: u64,
) -> Result<Option<Reservation<'static>>, CuResult> {
    if predicted == 0 {
        return Ok(None);
    }
    let ask = &mut Fixed {
        bytes: predicted,
        wait: false,
    };
    admit(call, dev, ask)
}
/// Libraries whose first look-up is still to come: while 0, look-ups take no lock.
static LAZY: AtomicUsize = AtomicUsize::new(0);

/// The device's free memory now, from the driver (`None`: no current context).
fn free_now() -> Option<u64> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers.
    unsafe { real::cuMemGetInfo_v2(&mut free, &mut total) }
        .is_ok()
        .then_some(free as u64)
}

/// Whether the driver loads modules lazily (`CUDA_MODULE_LOADING`, LAZY by default):
/// asked once.
fn lazy_loading() -> bool {
    static MODE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
    let mut mode = MODE.load(Ordering::Relaxed);
    if mode == 0 {
        // SAFETY: a valid out-pointer.
        if !unsafe { real::cuModuleGetLoadingMode(&mut mode) }.is_ok() {
            mode = LOADING_EAGER;
        }
        MODE.store(mode, Ordering::Relaxed);
    }
    mode == LOADING_LAZY
}

/// `CU_MODULE_EAGER_LOADING`, `CU_MODULE_LAZY_LOADING`.
const LOADING_EAGER: i32 = 1;
const LOADING_LAZY: i32 = 2;

/// Runs `real` and returns how much the device's use changed across it (grown:
/// positive; 0 when it cannot be read).
fn measure(real: impl FnOnce() -> CuResult) -> (CuResult, i64) {
    let before = free_now();
    let rc = real();
    let change = match (before, rc.is_ok().then(free_now).flatten()) {
        (Some(before), Some(after)) => clamp_i64(before).saturating_sub(clamp_i64(after)),
        _ => 0,
    };
    (rc, change)
}

/// Admits `bytes` that the device already holds (the call has happened): `Ok` when they
/// fit and are now charged, else the refusal.
fn admit_held(call: &str, dev: &DeviceCx, bytes: u64) -> Result<(), CuResult> {
    let ask = &mut Fixed { bytes, wait: false };
    if let Some(r) = admit(call, dev, ask)? {
        r.commit();
    }
    Ok(())
}

/// A module or library load (`real`), whose handle the driver writes to `out`. `lazy`:
/// a library, whose globals may come at its first look-up instead. A load whose growth
/// does not fit is undone with `unload` and refused.
pub fn load<H: Opaque>(
    cx: Cx,
    call: &'static str,
    out: *mut H,
    lazy: bool,
    image: Image,
    real: impl FnOnce() -> CuResult,
    unload: impl FnOnce(H) -> CuResult,
) -> CuResult {
    let Some(dev) = cx.current_device() else {
        return real();
    };
    let (device, d) = (dev.ordinal, dev.ledger);
    if crate::admit::capture::any() {
        // Not the moment for calls of our own; the footprint re-read counts it.
        return real();
    }
    crate::admit::footprint::settle_before_admission(&dev);
    if lazy && lazy_loading() {
        // Nothing arrives at a lazily loaded library's load (cudart makes hundreds of
        // them at start-up): its first look-up is admitted and measured instead, and an
        // image the program carries read-only, or a compressed entry, is read then.
        let pending = match image {
            Image::Memory(p) if carried_read_only(p) => (0, p as usize),
            _ => match (predicted(call, image, device, false), image) {
                (Ok(bytes), _) => (bytes, 0),
                (Err(Some(Unknown::Unexpanded)), Image::Memory(p)) => (0, p as usize),
                _ => (0, 0),
            },
        };
        let rc = real();
        if rc.is_ok() && !out.is_null() {
            // SAFETY: the driver just wrote the handle.
            let handle = unsafe { *out };
            remember_pending(handle, device, d, 0, false, pending);
        }
        return rc;
    }
    let predicted = predicted(call, image, device, true).unwrap_or(0);
    let reservation = match admit_predicted(call, &dev, predicted) {
        Ok(r) => r,
        Err(refusal) => return refusal,
    };
    let (rc, change) = measure(real);
    let grown = change.max(0).unsigned_abs();
    if !rc.is_ok() || out.is_null() {
        return rc;
    }
    // SAFETY: the driver just wrote the handle.
    let handle = unsafe { *out };
    let extra = grown.saturating_sub(predicted);
    if extra > 0
        && let Err(refused) = admit_held(call, &dev, extra)
    {
        let _ = unload(handle);
        drop(reservation);
        return refused;
    }
    if let Some(r) = reservation {
        r.commit();
    }
    let bytes = predicted.max(grown);
    remember(handle, device, d, bytes, !lazy || bytes > 0);
    CuResult::SUCCESS
}

/// Whether the fatbinary at `image` (or the one a wrapper there names) lies in a segment
/// of a loaded object (the program, a shared library) that is mapped without write
/// permission: a fatbinary the program carries, as nvcc places it, which stays as it is
/// while the object is loaded.
fn carried_read_only(image: *const c_void) -> bool {
    if image.is_null() {
        return false;
    }
    let at = image::wrapped(&Memory(image as usize)).map_or(image as usize, |fat| fat as usize);
    in_read_only_segment(at)
}

/// Whether `at` lies in a loadable segment, mapped without write permission, of an
/// object the dynamic loader has loaded.
fn in_read_only_segment(at: usize) -> bool {
    /// `(address, found read-only)`, filled by [`visit`].
    struct Search(usize, bool);
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> libc::c_int {
        // SAFETY: the loader passes a valid `dl_phdr_info` for the call, and `data` is the
        // `Search` that `in_read_only_segment` handed to `dl_iterate_phdr`, borrowed by no
        // one else meanwhile.
        let (info, search) = unsafe { (&*info, &mut *data.cast::<Search>()) };
        if info.dlpi_phdr.is_null() {
            return 0;
        }
        for i in 0..usize::from(info.dlpi_phnum) {
            // SAFETY: `dlpi_phdr` holds `dlpi_phnum` program headers.
            let ph = unsafe { &*info.dlpi_phdr.add(i) };
            if ph.p_type != libc::PT_LOAD {
                continue;
            }
            let start = (info.dlpi_addr as usize).wrapping_add(ph.p_vaddr as usize);
            let end = start.saturating_add(ph.p_memsz as usize);
            if (start..end).contains(&search.0) {
                search.1 = ph.p_flags & libc::PF_W == 0;
                return 1;
            }
        }
        0
    }
    let mut search = Search(at, false);
    // SAFETY: `visit` only reads the headers it is given and writes `search`, which
    // outlives the call; it neither unwinds nor allocates.
    unsafe {
        libc::dl_iterate_phdr(Some(visit), (&mut search as *mut Search).cast());
    }
    search.1
}

/// A look-up in `library` (`cuLibraryGetGlobal`, `…GetManaged`, `…GetModule`,
/// `…GetKernel`) that may bring a lazily loaded library's globals in: measured the first
/// time only.
pub fn lookup(
    cx: Cx,
    call: &'static str,
    library: Library,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    if LAZY.load(Ordering::Acquire) == 0 || crate::admit::capture::any() {
        return real();
    }
    let pending = LOADS
        .lock()
        .iter()
        .find(|l| l.handle == library.key() && !l.resident)
        .map(|l| (l.device, l.pending, l.later));
    let Some((device, predicted, later)) = pending else {
        return real();
    };
    let Some(dev) = cx.device(device) else {
        return real();
    };
    let d = dev.ledger;
    // The library's image, read now where it was not at the load (an image the program
    // carries read-only; a compressed entry, read again: if the caller has freed or
    // changed it since, it cannot say, or says less, and the measurement is the charge).
    let predicted = if later == 0 {
        predicted
    } else {
        let image = Image::Memory(later as *const c_void);
        self::predicted(call, image, device, true).unwrap_or(0)
    };
    let books = d.books_epoch();
    // What the image said, admitted before the globals arrive: a look-up that does not
    // fit fails before the driver holds any of it (the library stays to be loaded).
    let reservation = match admit_predicted(call, &dev, predicted) {
        Ok(r) => r,
        Err(refusal) => return refusal,
    };
    let (rc, change) = measure(real);
    if !rc.is_ok() {
        return rc;
    }
    let grown = change.max(0).unsigned_abs();
    let extra = grown.saturating_sub(predicted);
    let fits = if extra == 0 {
        Ok(())
    } else {
        admit_held(call, &dev, extra)
    };
    if fits.is_err() {
        // Held already and nothing to undo: charged all the same, until the unload.
        super::after::charge_after(d, 0, extra);
    }
    if let Some(r) = reservation {
        r.commit();
    }
    let grown = predicted.max(grown);
    let mut loads = LOADS.lock();
    if let Some(l) = loads
        .iter_mut()
        .find(|l| l.handle == library.key() && !l.resident)
    {
        l.resident = true;
        LAZY.fetch_sub(1, Ordering::AcqRel);
        if l.books == books {
            l.bytes = l.bytes.saturating_add(grown);
        }
    } else if d.books_epoch() == books {
        // Another thread's first look-up brought the globals in and recorded them while
        // this one was measuring: what this one charged would never be given back at the
        // unload.
        d.release(grown);
    }
    fits.err().unwrap_or(CuResult::SUCCESS)
}

/// A module's or library's unload, or a context's destruction: what it held is given
/// back, and a context's modules and libraries go with it.
pub fn unload(handle: impl Opaque, real: impl FnOnce() -> CuResult) -> CuResult {
    let rc = real();
    if !rc.is_ok() {
        return rc;
    }
    let key = handle.key();
    let gone: Vec<Load> = {
        let mut loads = LOADS.lock();
        let mut gone = Vec::new();
        let mut i = 0;
        while i < loads.len() {
            if loads[i].handle == key || (key != 0 && loads[i].context == key) {
                gone.push(loads.swap_remove(i));
            } else {
                i += 1;
            }
        }
        gone
    };
    for l in gone {
        if !l.resident {
            LAZY.fetch_sub(1, Ordering::AcqRel);
        }
        if let Some(d) = crate::runtime::ledger().device(l.device)
            && d.books_epoch() == l.books
        {
            d.release(l.bytes);
        }
    }
    rc
}

/// A context created on `device` while the process already has one there (a second
/// context costs device memory of its own, which the footprint charges only for the
/// first): measured like a load when this thread's current context is on `device`, and
/// destroyed again with `destroy` if it does not fit.
pub fn another_context(
    dev: &DeviceCx,
    out: *mut Context,
    create: impl FnOnce() -> CuResult,
    destroy: impl FnOnce(Context) -> CuResult,
) -> CuResult {
    let (device, d) = (dev.ordinal, dev.ledger);
    if !crate::admit::footprint::has_context(device)
        || crate::admit::capture::any()
        || crate::runtime::current_device() != Some(device)
    {
        return create();
    }
    let (rc, change) = measure(create);
    let grown = change.max(0).unsigned_abs();
    if !rc.is_ok() || out.is_null() || grown == 0 {
        return rc;
    }
    // SAFETY: the driver just wrote the context.
    let handle = unsafe { *out };
    if let Err(refused) = admit_held("cuCtxCreate", dev, grown) {
        let _ = destroy(handle);
        return refused;
    }
    remember(handle, device, d, grown, true);
    rc
}

/// What one limit of one context holds, as charged: the bytes of its value above
/// `base`, the value it had when first seen (the driver's default; nothing is charged
/// for a limit at or below it), in the books `books` of its device.
struct LimitHeld {
    context: usize,
    device: usize,
    /// 0 stack, 1 printf FIFO, 2 heap.
    limit: usize,
    base: u64,
    charged: u64,
    books: u64,
}

/// The limits of every context that set one.
static LIMITS: Lock<Vec<LimitHeld>> = Lock::new(Vec::new());

/// Held across a whole `cuCtxSetLimit`: the old value's reading, the admission, the
/// driver's call and the settling of what it charges. Limit changes are rare; one at a
/// time in the process is one at a time per context.
static SETTING: Lock<()> = Lock::new(());

/// What `unit` bytes a step of the limit cost on `device` (`None`: unknown): one for the
/// heap and the FIFO, the device's resident threads for the stack (asked once).
fn unit_bytes(limit: usize, device: usize) -> Option<u64> {
    if limit as i32 != LIMIT_STACK_SIZE {
        return Some(1);
    }
    static THREADS: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
    let known = THREADS.get(device)?;
    let seen = known.load(Ordering::Relaxed);
    if seen != 0 {
        return Some(seen);
    }
    /// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`, `…_MAX_THREADS_PER_MULTIPROCESSOR`.
    const SMS: i32 = 16;
    const THREADS_PER_SM: i32 = 39;
    let (sms, per_sm) = attributes(device, SMS, THREADS_PER_SM)?;
    let threads = u64::from(sms) * u64::from(per_sm);
    (threads > 0).then(|| {
        known.store(threads, Ordering::Relaxed);
        threads
    })
}

/// The current context's `limit` (`CU_LIMIT_*`), from the driver.
fn limit_now(limit: i32) -> Option<u64> {
    let mut value = 0usize;
    // SAFETY: a valid out-pointer.
    unsafe { real::cuCtxGetLimit(&mut value, limit) }
        .is_ok()
        .then_some(value as u64)
}

/// The base and the charge of `context`'s `limit` in `books`, which is `now` when the
/// limit was never seen (or its record is from books cleared since).
fn held(context: usize, device: usize, limit: usize, now: u64, books: u64) -> (u64, u64) {
    let mut limits = LIMITS.lock();
    let fresh = LimitHeld {
        context,
        device,
        limit,
        base: now,
        charged: 0,
        books,
    };
    match limits
        .iter_mut()
        .find(|h| h.context == context && h.limit == limit)
    {
        Some(h) if h.books == books && h.device == device => (h.base, h.charged),
        Some(h) => {
            *h = fresh;
            (now, 0)
        }
        None => {
            limits.push(fresh);
            (now, 0)
        }
    }
}

/// `cuCtxSetLimit(limit, value)` on the current context (`real`).
///
/// A limit costs its value above the one it had when first seen, times what a step costs
/// ([`unit_bytes`]): charged in full before the driver is asked (a limit that does not
/// fit is never set), and given back when the limit comes down, exactly what it was
/// charged. Nothing is measured: a reading of the device's free memory around the call
/// would count any allocation another thread makes meanwhile as the limit's. The whole
/// change is made under [`SETTING`], so two threads never both start from one old value.
pub fn set_limit(cx: Cx, limit: i32, value: usize, real: impl Fn(usize) -> CuResult) -> CuResult {
    let Some(dev) = cx.current_device() else {
        return real(value);
    };
    let (device, d) = (dev.ordinal, dev.ledger);
    let Ok(slot) = usize::try_from(limit) else {
        return real(value);
    };
    if slot > 2 || crate::admit::capture::any() {
        return real(value);
    }
    let _setting = SETTING.lock();
    let mut context = Context::NULL;
    // SAFETY: a valid out-pointer.
    let current = unsafe { real::cuCtxGetCurrent(&mut context) }.is_ok() && !context.is_null();
    let (Some(old), Some(unit), true) = (limit_now(limit), unit_bytes(slot, device), current)
    else {
        // No current context (the driver refuses), or a stack whose cost the device
        // does not say: the footprint re-read charges what it holds.
        return real(value);
    };
    let context = context.key();
    let books = d.books_epoch();
    let (base, charged) = held(context, device, slot, old, books);
    let cost = |v: u64| v.saturating_sub(base).saturating_mul(unit);
    let call = "cuCtxSetLimit";
    let wanted = cost(value as u64);
    let reservation = if wanted > charged {
        let ask = &mut Fixed {
            bytes: wanted - charged,
            wait: false,
        };
        match admit(call, &dev, ask) {
            Ok(r) => r,
            Err(rc) => return rc,
        }
    } else {
        None
    };
    let rc = real(value);
    if !rc.is_ok() {
        return rc;
    }
    // The driver may round the value: charged as it reports it.
    let now = cost(limit_now(limit).unwrap_or(value as u64));
    let booked = charged.saturating_add(reservation.as_ref().map_or(0, Reservation::bytes));
    if now > booked
        && let Err(refused) = admit_held(call, &dev, now - booked)
    {
        let _ = real(old as usize);
        return refused;
    }
    if let Some(r) = reservation {
        r.commit();
    }
    if booked > now {
        d.release(booked - now);
    }
    let mut limits = LIMITS.lock();
    if let Some(h) = limits
        .iter_mut()
        .find(|h| h.context == context && h.limit == slot)
    {
        h.charged = now;
    }
    CuResult::SUCCESS
}

/// `context` was destroyed: what its limits were charged is given back (the driver
/// freed their memory with it).
pub fn context_destroyed(context: Context) {
    // Not while a limit of it is being set: that change settles its own charge first
    // (a destroy between its driver call and its settling would give back twice).
    let _setting = SETTING.lock();
    let key = context.key();
    let gone: Vec<LimitHeld> = {
        let mut limits = LIMITS.lock();
        let (gone, kept) = std::mem::take(&mut *limits)
            .into_iter()
            .partition(|h| h.context == key);
        *limits = kept;
        gone
    };
    for h in gone {
        if let Some(d) = crate::runtime::ledger().device(h.device)
            && d.books_epoch() == h.books
        {
            d.release(h.charged);
        }
    }
}

/// The device's last context is gone, its modules and limits with it.
pub fn context_gone(device: usize) {
    let mut loads = LOADS.lock();
    let before = loads.len();
    let lazy_gone = loads
        .iter()
        .filter(|l| l.device == device && !l.resident)
        .count();
    loads.retain(|l| l.device != device);
    debug_assert!(loads.len() <= before);
    drop(loads);
    LAZY.fetch_sub(lazy_gone, Ordering::AcqRel);
    LIMITS.lock().retain(|h| h.device != device);
}

/// In the child of `fork()`: the parent's modules are not the child's (it has no context).
///
/// # Safety
/// Only from an at-fork child handler.
pub unsafe fn after_fork() {
    // SAFETY: the caller's guarantee.
    unsafe {
        LOADS.reset_in_child(Vec::new());
        LIMITS.reset_in_child(Vec::new());
        SETTING.reset_in_child(());
    }
    LAZY.store(0, Ordering::Release);
}
