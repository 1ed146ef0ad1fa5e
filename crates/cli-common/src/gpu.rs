//! The CUDA driver and NVML as the CLI asks them: opened at run time with `dlopen`, so
//! the CLI runs (and says what is missing) on machines without either.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};

/// A library opened with `dlopen`, never closed (the drivers do not like being unloaded).
struct Handle(*mut c_void);

/// `dlopen(name, RTLD_NOW | RTLD_LOCAL)`, never closed; `Err` says why it failed
/// (dlerror's words, or "not found").
pub fn dlopen_local(name: &CStr) -> Result<*mut c_void, String> {
    // SAFETY: dlopen with a NUL-terminated name; dlerror's answer is copied at once.
    unsafe {
        let handle = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if handle.is_null() {
            let error = libc::dlerror();
            let reason = if error.is_null() {
                "not found".to_string()
            } else {
                CStr::from_ptr(error).to_string_lossy().into_owned()
            };
            return Err(reason);
        }
        Ok(handle)
    }
}

impl Handle {
    fn open(name: &CStr) -> Result<Handle, String> {
        dlopen_local(name).map(Handle)
    }

    /// The address of `name`, or null.
    fn symbol(&self, name: &CStr) -> *mut c_void {
        // SAFETY: a live handle and a NUL-terminated name.
        unsafe { libc::dlsym(self.0, name.as_ptr()) }
    }

    /// The file the library was loaded from, through one of its symbols.
    fn path_of(&self, symbol: *mut c_void) -> Option<String> {
        if symbol.is_null() {
            return None;
        }
        // SAFETY: dladdr fills a plain struct; dli_fname points into the loader's map.
        unsafe {
            let mut info: libc::Dl_info = std::mem::zeroed();
            if libc::dladdr(symbol, &mut info) == 0 || info.dli_fname.is_null() {
                return None;
            }
            Some(
                CStr::from_ptr(info.dli_fname)
                    .to_string_lossy()
                    .into_owned(),
            )
        }
    }
}

/// Declares a table of function pointers looked up by name; `required` ones must exist.
macro_rules! functions {
    ($table:ident { $($name:ident : fn($($arg:ty),*) -> $ret:ty;)* }) => {
        #[allow(non_snake_case)]
        struct $table { $($name: Option<unsafe extern "C" fn($($arg),*) -> $ret>,)* }
        impl $table {
            fn load(handle: &Handle) -> $table {
                $table {
                    $($name: {
                        let name = CString::new(stringify!($name)).expect("no NUL in a name");
                        let pointer = handle.symbol(&name);
                        // SAFETY: the symbol, when present, has the documented C signature
                        // declared here.
                        (!pointer.is_null()).then(|| unsafe {
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> $ret>(pointer)
                        })
                    },)*
                }
            }
        }
    };
}

functions!(CudaFns {
    cuDriverGetVersion: fn(*mut c_int) -> c_int;
    cuInit: fn(c_uint) -> c_int;
    cuDeviceGetCount: fn(*mut c_int) -> c_int;
    cuDeviceGet: fn(*mut c_int, c_int) -> c_int;
    cuDeviceGetName: fn(*mut c_char, c_int, c_int) -> c_int;
    cuDeviceTotalMem_v2: fn(*mut usize, c_int) -> c_int;
    cuDeviceGetUuid: fn(*mut [u8; 16], c_int) -> c_int;
    cuDeviceGetUuid_v2: fn(*mut [u8; 16], c_int) -> c_int;
    cuDevicePrimaryCtxRetain: fn(*mut *mut c_void, c_int) -> c_int;
    cuDevicePrimaryCtxRelease_v2: fn(c_int) -> c_int;
    cuCtxSetCurrent: fn(*mut c_void) -> c_int;
    cuMemGetInfo_v2: fn(*mut usize, *mut usize) -> c_int;
    cuMemAlloc_v2: fn(*mut u64, usize) -> c_int;
    cuMemFree_v2: fn(u64) -> c_int;
});

/// CUDA's error code for a missing entry point (`CUDA_ERROR_NOT_FOUND`).
const NOT_FOUND: c_int = 500;

/// Calls `f` if the driver has it; a missing entry point answers [`NOT_FOUND`].
macro_rules! call {
    ($self:ident . $name:ident ( $($arg:expr),* )) => {
        match $self.fns.$name {
            // SAFETY: the driver's function with its documented signature; every pointer
            // passed is a valid out-pointer or buffer of the size given.
            Some(f) => unsafe { f($($arg),*) },
            None => NOT_FOUND,
        }
    };
}

/// `libcuda.so.1`, as the loader finds it for this process.
pub struct Cuda {
    handle: Handle,
    fns: CudaFns,
}

/// One device as CUDA numbers it (after `CUDA_VISIBLE_DEVICES`).
#[derive(Clone, Debug)]
pub struct CudaDevice {
    pub ordinal: u32,
    pub name: String,
    pub total: u64,
    pub uuid: Option<String>,
}

impl Cuda {
    pub fn open() -> Result<Cuda, String> {
        let handle = Handle::open(c"libcuda.so.1")?;
        let fns = CudaFns::load(&handle);
        Ok(Cuda { handle, fns })
    }

    /// The file the driver was loaded from.
    pub fn path(&self) -> Option<String> {
        self.handle.path_of(self.handle.symbol(c"cuInit"))
    }

    /// The CUDA version the driver supports, e.g. 13000 for 13.0.
    pub fn driver_version(&self) -> Result<i32, c_int> {
        let mut version = 0;
        match call!(self.cuDriverGetVersion(&mut version)) {
            0 => Ok(version),
            rc => Err(rc),
        }
    }

    pub fn init(&self) -> Result<(), c_int> {
        match call!(self.cuInit(0)) {
            0 => Ok(()),
            rc => Err(rc),
        }
    }

    pub fn devices(&self) -> Result<Vec<CudaDevice>, c_int> {
        let mut count = 0;
        let rc = call!(self.cuDeviceGetCount(&mut count));
        if rc != 0 {
            return Err(rc);
        }
        let mut devices = Vec::new();
        for ordinal in 0..count.max(0) {
            let mut device = 0;
            let rc = call!(self.cuDeviceGet(&mut device, ordinal));
            if rc != 0 {
                return Err(rc);
            }
            let mut name = [0 as c_char; 256];
            let name = if call!(self.cuDeviceGetName(name.as_mut_ptr(), 255, device)) == 0 {
                // SAFETY: the driver wrote a NUL-terminated string into the buffer.
                unsafe { CStr::from_ptr(name.as_ptr()) }
                    .to_string_lossy()
                    .into_owned()
            } else {
                "unknown".to_string()
            };
            let mut total = 0usize;
            let _ = call!(self.cuDeviceTotalMem_v2(&mut total, device));
            let mut uuid = [0u8; 16];
            let uuid = (call!(self.cuDeviceGetUuid_v2(&mut uuid, device)) == 0
                || call!(self.cuDeviceGetUuid(&mut uuid, device)) == 0)
                .then(|| cudabudget_spec::record::gpu_uuid(&uuid));
            devices.push(CudaDevice {
                ordinal: ordinal as u32,
                name,
                total: total as u64,
                uuid,
            });
        }
        Ok(devices)
    }

    /// Makes device 0's primary context current (what a first `cudaMalloc` does).
    pub fn activate(&self, ordinal: c_int) -> Result<(), c_int> {
        let mut device = 0;
        let rc = call!(self.cuDeviceGet(&mut device, ordinal));
        if rc != 0 {
            return Err(rc);
        }
        let mut context = std::ptr::null_mut();
        let rc = call!(self.cuDevicePrimaryCtxRetain(&mut context, device));
        if rc != 0 {
            return Err(rc);
        }
        match call!(self.cuCtxSetCurrent(context)) {
            0 => Ok(()),
            rc => Err(rc),
        }
    }

    /// (free, total) of the current context's device.
    pub fn mem_info(&self) -> Result<(u64, u64), c_int> {
        let (mut free, mut total) = (0usize, 0usize);
        match call!(self.cuMemGetInfo_v2(&mut free, &mut total)) {
            0 => Ok((free as u64, total as u64)),
            rc => Err(rc),
        }
    }

    /// Allocates `bytes` and frees them again; the driver's answer to the allocation.
    pub fn alloc_and_free(&self, bytes: u64) -> c_int {
        let mut pointer = 0u64;
        let rc = call!(self.cuMemAlloc_v2(&mut pointer, bytes as usize));
        if rc == 0 {
            let _ = call!(self.cuMemFree_v2(pointer));
        }
        rc
    }

    pub fn release(&self, ordinal: c_int) {
        let _ = call!(self.cuDevicePrimaryCtxRelease_v2(ordinal));
    }
}

/// A CUDA error code with its name, where it is one users meet.
pub fn cuda_error(rc: c_int) -> String {
    let name = match rc {
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        35 => "CUDA_ERROR_INSUFFICIENT_DRIVER",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        304 => "CUDA_ERROR_OPERATING_SYSTEM",
        302 => "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
        500 => "CUDA_ERROR_NOT_FOUND",
        800 => "CUDA_ERROR_NOT_PERMITTED",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return format!("CUDA error {rc}"),
    };
    format!("{name} ({rc})")
}

#[repr(C)]
#[derive(Default)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

functions!(NvmlFns {
    nvmlInit_v2: fn() -> c_int;
    nvmlDeviceGetCount_v2: fn(*mut c_uint) -> c_int;
    nvmlDeviceGetHandleByIndex_v2: fn(c_uint, *mut *mut c_void) -> c_int;
    nvmlDeviceGetUUID: fn(*mut c_void, *mut c_char, c_uint) -> c_int;
    nvmlDeviceGetName: fn(*mut c_void, *mut c_char, c_uint) -> c_int;
    nvmlDeviceGetMemoryInfo: fn(*mut c_void, *mut NvmlMemory) -> c_int;
    nvmlSystemGetDriverVersion: fn(*mut c_char, c_uint) -> c_int;
});

/// `libnvidia-ml.so.1`, initialised.
pub struct Nvml {
    handle: Handle,
    fns: NvmlFns,
}

/// A physical GPU as NVML sees it.
#[derive(Clone, Debug)]
pub struct NvmlDevice {
    pub index: u32,
    pub uuid: Option<String>,
    pub name: Option<String>,
    pub total: u64,
    pub used: u64,
}

fn text(buffer: &[c_char]) -> String {
    // SAFETY: NVML wrote a NUL-terminated string within the buffer (it was zeroed and
    // its last byte is never written).
    unsafe { CStr::from_ptr(buffer.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

impl Nvml {
    pub fn open() -> Result<Nvml, String> {
        let handle = Handle::open(c"libnvidia-ml.so.1")?;
        let fns = NvmlFns::load(&handle);
        let nvml = Nvml { handle, fns };
        match call!(nvml.nvmlInit_v2()) {
            0 => Ok(nvml),
            NOT_FOUND => Err("it has no nvmlInit_v2".into()),
            rc => Err(format!("nvmlInit_v2 failed with NVML error {rc}")),
        }
    }

    pub fn path(&self) -> Option<String> {
        self.handle.path_of(self.handle.symbol(c"nvmlInit_v2"))
    }

    /// The kernel driver's version ("580.95.05"), where NVML says.
    pub fn driver_version(&self) -> Option<String> {
        let mut buffer = [0 as c_char; 96];
        (call!(self.nvmlSystemGetDriverVersion(buffer.as_mut_ptr(), 95)) == 0)
            .then(|| text(&buffer))
    }

    /// Every GPU NVML sees, with its memory.
    pub fn devices(&self) -> Vec<NvmlDevice> {
        let mut count = 0;
        if call!(self.nvmlDeviceGetCount_v2(&mut count)) != 0 {
            return Vec::new();
        }
        (0..count.min(256))
            .filter_map(|index| {
                let mut device = std::ptr::null_mut();
                if call!(self.nvmlDeviceGetHandleByIndex_v2(index, &mut device)) != 0 {
                    return None;
                }
                let mut memory = NvmlMemory::default();
                if call!(self.nvmlDeviceGetMemoryInfo(device, &mut memory)) != 0 {
                    return None;
                }
                let mut uuid = [0 as c_char; 96];
                let uuid = (call!(self.nvmlDeviceGetUUID(device, uuid.as_mut_ptr(), 95)) == 0)
                    .then(|| text(&uuid));
                let mut name = [0 as c_char; 96];
                let name = (call!(self.nvmlDeviceGetName(device, name.as_mut_ptr(), 95)) == 0)
                    .then(|| text(&name));
                Some(NvmlDevice {
                    index,
                    uuid,
                    name,
                    total: memory.total,
                    used: memory.used,
                })
            })
            .collect()
    }
}
