//! Modules and libraries: device memory that arrives with a call that names no size
//! ([`crate::admit::loads`] admits what the image says and charges what it costs).

use std::ffi::{c_char, c_int, c_void};

use super::guard;
use crate::admit::loads::{self, Image};
use crate::sys::driver::{CuResult, DevicePtr, Kernel, Library, Module, real};

/// A module load (`real`): admitted for what its image says, then charged by what it
/// costs, unloaded again if that does not fit.
fn module_load(
    call: &'static str,
    module: *mut Module,
    image: Image,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    guard(call, || {
        let cx = enter!(real);
        // SAFETY: the module the driver just loaded.
        loads::load(cx, call, module, false, image, real, |m| unsafe {
            real::cuModuleUnload(m)
        })
    })
}

/// A library load (`real`): with lazy loading its globals come at its first look-up.
fn library_load(
    call: &'static str,
    library: *mut Library,
    image: Image,
    real: impl FnOnce() -> CuResult,
) -> CuResult {
    guard(call, || {
        let cx = enter!(real);
        // SAFETY: the library the driver just loaded.
        loads::load(cx, call, library, true, image, real, |l| unsafe {
            real::cuLibraryUnload(l)
        })
    })
}

/// # Safety
/// As the driver's `cuModuleLoad`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuModuleLoad(module: *mut Module, fname: *const c_char) -> CuResult {
    // SAFETY: the caller's arguments.
    module_load("cuModuleLoad", module, Image::File(fname), || unsafe {
        real::cuModuleLoad(module, fname)
    })
}

/// # Safety
/// As the driver's `cuModuleLoadData`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut Module, image: *const c_void) -> CuResult {
    // SAFETY: the caller's arguments.
    module_load(
        "cuModuleLoadData",
        module,
        Image::Memory(image),
        || unsafe { real::cuModuleLoadData(module, image) },
    )
}

/// # Safety
/// As the driver's `cuModuleLoadDataEx`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    module: *mut Module,
    image: *const c_void,
    n: u32,
    options: *mut c_int,
    values: *mut *mut c_void,
) -> CuResult {
    // SAFETY: the caller's arguments.
    module_load(
        "cuModuleLoadDataEx",
        module,
        Image::Memory(image),
        || unsafe { real::cuModuleLoadDataEx(module, image, n, options, values) },
    )
}

/// # Safety
/// As the driver's `cuModuleLoadFatBinary`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuModuleLoadFatBinary(
    module: *mut Module,
    fatbin: *const c_void,
) -> CuResult {
    // SAFETY: the caller's arguments.
    module_load(
        "cuModuleLoadFatBinary",
        module,
        Image::Memory(fatbin),
        || unsafe { real::cuModuleLoadFatBinary(module, fatbin) },
    )
}

/// # Safety
/// As the driver's `cuModuleUnload`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuModuleUnload(module: Module) -> CuResult {
    guard("cuModuleUnload", || {
        // SAFETY: the caller's argument.
        let unload = || unsafe { real::cuModuleUnload(module) };
        let _cx = enter!(books, unload);
        loads::unload(module, unload)
    })
}

/// # Safety
/// As the driver's `cuLibraryLoadData`.
#[cfg_attr(not(test), unsafe(no_mangle))]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLibraryLoadData(
    library: *mut Library,
    code: *const c_void,
    jit_options: *mut c_int,
    jit_values: *mut *mut c_void,
    n_jit: u32,
    lib_options: *mut c_int,
    lib_values: *mut *mut c_void,
    n_lib: u32,
) -> CuResult {
    // SAFETY: the caller's arguments.
    library_load(
        "cuLibraryLoadData",
        library,
        Image::Memory(code),
        || unsafe {
            real::cuLibraryLoadData(
                library,
                code,
                jit_options,
                jit_values,
                n_jit,
                lib_options,
                lib_values,
                n_lib,
            )
        },
    )
}

/// # Safety
/// As the driver's `cuLibraryLoadFromFile`.
#[cfg_attr(not(test), unsafe(no_mangle))]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLibraryLoadFromFile(
    library: *mut Library,
    file: *const c_char,
    jit_options: *mut c_int,
    jit_values: *mut *mut c_void,
    n_jit: u32,
    lib_options: *mut c_int,
    lib_values: *mut *mut c_void,
    n_lib: u32,
) -> CuResult {
    // SAFETY: the caller's arguments.
    library_load(
        "cuLibraryLoadFromFile",
        library,
        Image::File(file),
        || unsafe {
            real::cuLibraryLoadFromFile(
                library,
                file,
                jit_options,
                jit_values,
                n_jit,
                lib_options,
                lib_values,
                n_lib,
            )
        },
    )
}

/// # Safety
/// As the driver's `cuLibraryUnload`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuLibraryUnload(library: Library) -> CuResult {
    guard("cuLibraryUnload", || {
        // SAFETY: the caller's argument.
        let unload = || unsafe { real::cuLibraryUnload(library) };
        let _cx = enter!(books, unload);
        loads::unload(library, unload)
    })
}

/// # Safety
/// As the driver's `cuLibraryGetGlobal`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuLibraryGetGlobal(
    dptr: *mut DevicePtr,
    bytes: *mut usize,
    library: Library,
    name: *const c_char,
) -> CuResult {
    guard("cuLibraryGetGlobal", || {
        // SAFETY: the caller's arguments.
        let look_up = || unsafe { real::cuLibraryGetGlobal(dptr, bytes, library, name) };
        let cx = enter!(books, look_up);
        loads::lookup(cx, "cuLibraryGetGlobal", library, look_up)
    })
}

/// # Safety
/// As the driver's `cuLibraryGetManaged`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuLibraryGetManaged(
    dptr: *mut DevicePtr,
    bytes: *mut usize,
    library: Library,
    name: *const c_char,
) -> CuResult {
    guard("cuLibraryGetManaged", || {
        // SAFETY: the caller's arguments.
        let look_up = || unsafe { real::cuLibraryGetManaged(dptr, bytes, library, name) };
        let cx = enter!(books, look_up);
        loads::lookup(cx, "cuLibraryGetManaged", library, look_up)
    })
}

/// # Safety
/// As the driver's `cuLibraryGetModule`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuLibraryGetModule(module: *mut Module, library: Library) -> CuResult {
    guard("cuLibraryGetModule", || {
        // SAFETY: the caller's arguments.
        let look_up = || unsafe { real::cuLibraryGetModule(module, library) };
        let cx = enter!(books, look_up);
        loads::lookup(cx, "cuLibraryGetModule", library, look_up)
    })
}

/// # Safety
/// As the driver's `cuLibraryGetKernel`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuLibraryGetKernel(
    kernel: *mut Kernel,
    library: Library,
    name: *const c_char,
) -> CuResult {
    guard("cuLibraryGetKernel", || {
        // SAFETY: the caller's arguments.
        let look_up = || unsafe { real::cuLibraryGetKernel(kernel, library, name) };
        let cx = enter!(books, look_up);
        loads::lookup(cx, "cuLibraryGetKernel", library, look_up)
    })
}
