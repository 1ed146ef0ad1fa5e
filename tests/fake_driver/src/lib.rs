//! Paths of the C test fixtures that this crate's `build.rs` compiles from
//! `tests/fake_driver/` (and the two C programs of the benchmarks) into its `OUT_DIR`.
//!
//! cudabudget takes this crate as a **dev-dependency**: cargo builds it, and so needs a C
//! compiler, only for `cargo test`, `cargo bench` and `cargo clippy --all-targets`;
//! `cargo build` and `cargo install` never do.

/// The directory holding the fake `libcuda.so.1` (+ `libcuda.so`) and
/// `libnvidia-ml.so.1` (+ `libnvidia-ml.so`).
pub const FAKE_DRIVER_DIR: &str = env!("FAKE_DRIVER_DIR");
/// The fake `libcuda.so.1`.
pub const FAKE_CUDA_LIB: &str = env!("FAKE_CUDA_LIB");
/// The fake `libnvidia-ml.so.1`.
pub const FAKE_NVML_LIB: &str = env!("FAKE_NVML_LIB");
/// `client`: reaches the driver by `dlopen` (not linked to libcuda).
pub const FAKE_CLIENT: &str = env!("FAKE_CLIENT");
/// `client_linked`: the same source linked with `-lcuda` (no rpath).
pub const FAKE_CLIENT_LINKED: &str = env!("FAKE_CLIENT_LINKED");
/// `libthirdparty.so`, an `RTLD_NEXT` preload.
pub const FAKE_THIRDPARTY_LIB: &str = env!("FAKE_THIRDPARTY_LIB");
/// `prop_client`, the executor of `tests/property.rs`.
pub const FAKE_PROP_CLIENT: &str = env!("FAKE_PROP_CLIENT");
/// `driver_bench` (`scripts/gpu/bench/driver_bench.c`), for `cargo bench`.
pub const FAKE_DRIVER_BENCH: &str = env!("FAKE_DRIVER_BENCH");
/// `pair_loop` (`benches/pair_loop.c`), for counting the hooks' instructions.
pub const FAKE_PAIR_LOOP: &str = env!("FAKE_PAIR_LOOP");
