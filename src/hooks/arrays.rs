//! CUDA arrays and mipmapped arrays: charged by the size their descriptor gives.

use super::guard;
use crate::admit::flow::{self, array_bytes};
use crate::sys::driver::{
    Array, Array3dDescriptor, ArrayDescriptor, CuResult, MipmappedArray, real,
};

/// # Safety
/// As the driver's `cuArrayCreate_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuArrayCreate_v2(
    array: *mut Array,
    desc: *const ArrayDescriptor,
) -> CuResult {
    guard("cuArrayCreate", || {
        // SAFETY: the caller's arguments.
        let create = || unsafe { real::cuArrayCreate_v2(array, desc) };
        if desc.is_null() {
            return create();
        }
        // SAFETY: checked non-null.
        let d = unsafe { &*desc };
        let bytes = array_bytes(d.width, d.height, 0, d.format, d.num_channels, 1);
        let cx = enter!(create);
        flow::alloc_array(cx, "cuArrayCreate", bytes, array, create)
    })
}

/// # Safety
/// As the driver's `cuArray3DCreate_v2`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    array: *mut Array,
    desc: *const Array3dDescriptor,
) -> CuResult {
    guard("cuArray3DCreate", || {
        // SAFETY: the caller's arguments.
        let create = || unsafe { real::cuArray3DCreate_v2(array, desc) };
        if desc.is_null() {
            return create();
        }
        // SAFETY: checked non-null.
        let d = unsafe { &*desc };
        let bytes = array_bytes(d.width, d.height, d.depth, d.format, d.num_channels, 1);
        let cx = enter!(create);
        flow::alloc_array(cx, "cuArray3DCreate", bytes, array, create)
    })
}

/// # Safety
/// As the driver's `cuMipmappedArrayCreate`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    array: *mut MipmappedArray,
    desc: *const Array3dDescriptor,
    levels: u32,
) -> CuResult {
    guard("cuMipmappedArrayCreate", || {
        // SAFETY: the caller's arguments.
        let create = || unsafe { real::cuMipmappedArrayCreate(array, desc, levels) };
        if desc.is_null() {
            return create();
        }
        // SAFETY: checked non-null.
        let d = unsafe { &*desc };
        let bytes = array_bytes(d.width, d.height, d.depth, d.format, d.num_channels, levels);
        let cx = enter!(create);
        flow::alloc_array(cx, "cuMipmappedArrayCreate", bytes, array, create)
    })
}

/// # Safety
/// As the driver's `cuArrayDestroy`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuArrayDestroy(array: Array) -> CuResult {
    guard("cuArrayDestroy", || {
        // SAFETY: the caller's argument.
        let destroy = || unsafe { real::cuArrayDestroy(array) };
        let cx = enter!(destroy);
        flow::free_array(cx, array, destroy)
    })
}

/// # Safety
/// As the driver's `cuMipmappedArrayDestroy`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMipmappedArrayDestroy(array: MipmappedArray) -> CuResult {
    guard("cuMipmappedArrayDestroy", || {
        // SAFETY: the caller's argument.
        let destroy = || unsafe { real::cuMipmappedArrayDestroy(array) };
        let cx = enter!(destroy);
        flow::free_array(cx, array, destroy)
    })
}
