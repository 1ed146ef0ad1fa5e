//! Footprint: device memory no allocation call names counts against the budget too.
//! Contexts (measured by NVML, or estimated where it cannot measure), modules and
//! libraries (admitted from their image before the driver loads them, or measured at
//! the load), the device heap and stack limits, and memory found only by reconciling
//! with NVML; each is given back when it goes.

mod contexts;
mod loads_and_limits;
mod module_images;
