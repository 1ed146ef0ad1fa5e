//! NVML as the node services ask it: opened at run time with `dlopen` (the node binary
//! runs, and says why, on a machine without the driver), asked for each GPU's UUID and
//! memory, and asked again for health.
//!
//! The binaries' shared reader (`crates/cli-common/src/gpu.rs`, with CUDA beside NVML) serves
//! `status` and the exporter; this one is the few calls the device plugin needs (health).

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

/// `nvmlReturn_t`.
type Return = c_int;
/// `NVML_SUCCESS`.
const SUCCESS: Return = 0;

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Default)]
struct Memory {
    total: u64,
    free: u64,
    used: u64,
}

type Device = *mut c_void;

/// The entry points used, looked up once.
struct Functions {
    init: unsafe extern "C" fn() -> Return,
    count: unsafe extern "C" fn(*mut c_uint) -> Return,
    handle: unsafe extern "C" fn(c_uint, *mut Device) -> Return,
    uuid: unsafe extern "C" fn(Device, *mut c_char, c_uint) -> Return,
    memory: unsafe extern "C" fn(Device, *mut Memory) -> Return,
    error_string: Option<unsafe extern "C" fn(Return) -> *const c_char>,
}

/// One GPU as NVML numbers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    pub index: u32,
    /// `GPU-…`, as `NVIDIA_VISIBLE_DEVICES` and `CUDA_VISIBLE_DEVICES` accept it.
    pub uuid: String,
    /// Memory in bytes.
    pub total: u64,
}

/// A GPU's figures, or its index and why NVML cannot give them.
pub type GpuAnswer = Result<Gpu, (u32, String)>;

/// `libnvidia-ml.so.1`, initialised; never closed (drivers do not like being unloaded).
pub struct Nvml {
    functions: Functions,
}

// SAFETY: NVML is thread-safe (its documentation says so for every entry point used
// here); the struct holds only function pointers.
unsafe impl Send for Nvml {}
// SAFETY: as above: shared calls from several threads are allowed by NVML.
unsafe impl Sync for Nvml {}

fn symbol(handle: *mut c_void, name: &CStr) -> Result<*mut c_void, String> {
    // SAFETY: a live handle from dlopen and a NUL-terminated name.
    let pointer = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if pointer.is_null() {
        Err(format!(
            "libnvidia-ml.so.1 has no {}",
            name.to_string_lossy()
        ))
    } else {
        Ok(pointer)
    }
}

impl Nvml {
    /// Opens and initialises NVML.
    pub fn open() -> Result<Nvml, String> {
        let handle = cudabudget_cli_common::gpu::dlopen_local(c"libnvidia-ml.so.1")
            .map_err(|reason| format!("cannot load libnvidia-ml.so.1 ({reason})"))?;
        // SAFETY: (each transmute) the symbol has the documented C signature of NVML's
        // entry point of that name, which the field's type declares.
        let functions = unsafe {
            Functions {
                init: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> Return>(symbol(
                    handle,
                    c"nvmlInit_v2",
                )?),
                count: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut c_uint) -> Return,
                >(symbol(handle, c"nvmlDeviceGetCount_v2")?),
                handle: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(c_uint, *mut Device) -> Return,
                >(symbol(handle, c"nvmlDeviceGetHandleByIndex_v2")?),
                uuid: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(Device, *mut c_char, c_uint) -> Return,
                >(symbol(handle, c"nvmlDeviceGetUUID")?),
                memory: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(Device, *mut Memory) -> Return,
                >(symbol(handle, c"nvmlDeviceGetMemoryInfo")?),
                error_string:
                    symbol(handle, c"nvmlErrorString").ok().map(|pointer| {
                        std::mem::transmute::<
                            *mut c_void,
                            unsafe extern "C" fn(Return) -> *const c_char,
                        >(pointer)
                    }),
            }
        };
        let nvml = Nvml { functions };
        // SAFETY: nvmlInit_v2 takes no arguments.
        let rc = unsafe { (nvml.functions.init)() };
        nvml.check("nvmlInit_v2", rc)?;
        Ok(nvml)
    }

    /// NVML's words for `rc`, after the call's name.
    fn check(&self, call: &str, rc: Return) -> Result<(), String> {
        if rc == SUCCESS {
            return Ok(());
        }
        let words = self
            .functions
            .error_string
            // SAFETY: nvmlErrorString returns a static NUL-terminated string or null.
            .map(|f| unsafe { f(rc) })
            .filter(|p| !p.is_null())
            // SAFETY: non-null, NUL-terminated, static.
            .map(|p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            .unwrap_or_else(|| "unknown error".to_string());
        Err(format!("{call}: {words} (NVML error {rc})"))
    }

    fn device(&self, index: u32) -> Result<Device, String> {
        let mut device: Device = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let rc = unsafe { (self.functions.handle)(index, &mut device) };
        self.check("nvmlDeviceGetHandleByIndex_v2", rc)?;
        Ok(device)
    }

    fn memory(&self, device: Device) -> Result<u64, String> {
        let mut memory = Memory::default();
        // SAFETY: a handle NVML gave and a valid out-pointer of nvmlMemory_t's layout.
        let rc = unsafe { (self.functions.memory)(device, &mut memory) };
        self.check("nvmlDeviceGetMemoryInfo", rc)?;
        Ok(memory.total)
    }

    /// Every GPU of the machine, in NVML's order: each one's figures, or its index and
    /// why NVML cannot give them (a GPU lost since boot).
    pub fn gpus(&self) -> Result<Vec<GpuAnswer>, String> {
        let mut count: c_uint = 0;
        // SAFETY: a valid out-pointer.
        let rc = unsafe { (self.functions.count)(&mut count) };
        self.check("nvmlDeviceGetCount_v2", rc)?;
        Ok((0..count)
            .map(|index| self.gpu(index).map_err(|e| (index, e)))
            .collect())
    }

    fn gpu(&self, index: u32) -> Result<Gpu, String> {
        let device = self.device(index)?;
        // NVML_DEVICE_UUID_V2_BUFFER_SIZE is 96.
        let mut buffer = [0 as c_char; 96];
        // SAFETY: a handle NVML gave and a buffer of the length passed.
        let rc = unsafe { (self.functions.uuid)(device, buffer.as_mut_ptr(), 96) };
        self.check("nvmlDeviceGetUUID", rc)?;
        // SAFETY: NVML wrote a NUL-terminated string into the buffer (success); the
        // buffer's last byte was never written past.
        let uuid = unsafe { CStr::from_ptr(buffer.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        Ok(Gpu {
            index,
            uuid,
            total: self.memory(device)?,
        })
    }

    /// Whether NVML still answers for the GPU at `index` (a lost or fallen-off GPU does
    /// not: `NVML_ERROR_GPU_IS_LOST`); `Err` says why not.
    pub fn health(&self, index: u32) -> Result<(), String> {
        let device = self.device(index)?;
        self.memory(device).map(|_| ())
    }
}
