//! Builds the test fixtures in `tests/fake_driver/` (a fake `libcuda.so.1`, a fake
//! `libnvidia-ml.so.1`, the C test clients and a third-party `RTLD_NEXT` preload) into
//! `$OUT_DIR/fake/` and exports their paths to every target of the package:
//! `FAKE_DRIVER_DIR`, `FAKE_CLIENT`, `FAKE_CLIENT_LINKED`, `FAKE_THIRDPARTY_LIB`,
//! `FAKE_PROP_CLIENT` (and, for convenience, `FAKE_CUDA_LIB`, `FAKE_NVML_LIB`).
//! Nothing here is linked into the crate itself.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

const CFLAGS: &[&str] = &["-std=gnu11", "-O2", "-g", "-Wall", "-Wextra", "-Werror"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=tests/fake_driver");
    println!("cargo:rerun-if-changed=scripts/gpu/bench/driver_bench.c");
    println!("cargo:rerun-if-changed=benches/pair_loop.c");

    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let src = manifest.join("tests/fake_driver");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR")).join("fake");
    fs::create_dir_all(&out).expect("create OUT_DIR/fake");

    let compiler = cc::Build::new().cargo_metadata(false).get_compiler();
    let build = |output: &str, sources: &[&str], extra: &[&str]| -> PathBuf {
        let target = out.join(output);
        let mut cmd = compiler.to_command();
        cmd.args(CFLAGS)
            .arg(format!("-I{}", src.display()))
            .arg("-o")
            .arg(&target);
        for s in sources {
            cmd.arg(src.join(s));
        }
        cmd.args(extra);
        let status = cmd
            .status()
            .unwrap_or_else(|e| panic!("cannot run the C compiler ({cmd:?}): {e}"));
        assert!(status.success(), "building {output} failed: {cmd:?}");
        target
    };

    let cuda = build(
        "libcuda.so.1",
        &["fake_cuda.c"],
        &[
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcuda.so.1",
            "-Wl,-Bsymbolic",
            "-pthread",
        ],
    );
    symlink(&out, "libcuda.so.1", "libcuda.so");

    let nvml = build(
        "libnvidia-ml.so.1",
        &["fake_nvml.c"],
        &[
            "-shared",
            "-fPIC",
            "-Wl,-soname,libnvidia-ml.so.1",
            "-Wl,-Bsymbolic",
            "-ldl",
            "-pthread",
        ],
    );
    symlink(&out, "libnvidia-ml.so.1", "libnvidia-ml.so");

    let client = build("client", &["client.c"], &["-ldl", "-pthread"]);
    let libdir = format!("-L{}", out.display());
    let client_linked = build(
        "client_linked",
        &["client.c"],
        &["-DLINKED", &libdir, "-lcuda", "-ldl", "-pthread"],
    );
    // The executor of tests/property.rs.
    let prop_client = build("prop_client", &["prop_client.c"], &["-ldl", "-pthread"]);
    let thirdparty = build(
        "libthirdparty.so",
        &["thirdparty.c"],
        &["-shared", "-fPIC", "-ldl"],
    );

    // The driver benchmark of scripts/gpu, built here too so `cargo bench` runs it
    // against the fake driver.
    let driver_bench = build(
        "driver_bench",
        &["../../scripts/gpu/bench/driver_bench.c"],
        &["-ldl", "-pthread"],
    );

    // A bare pair loop, for counting the hooks' instructions (cargo bench, callgrind).
    let pair_loop = build("pair_loop", &["../../benches/pair_loop.c"], &["-ldl"]);

    let export = |name: &str, path: &Path| println!("cargo:rustc-env={name}={}", path.display());
    export("FAKE_DRIVER_DIR", &out);
    export("FAKE_CUDA_LIB", &cuda);
    export("FAKE_NVML_LIB", &nvml);
    export("FAKE_CLIENT", &client);
    export("FAKE_CLIENT_LINKED", &client_linked);
    export("FAKE_THIRDPARTY_LIB", &thirdparty);
    export("FAKE_PROP_CLIENT", &prop_client);
    export("FAKE_DRIVER_BENCH", &driver_bench);
    export("FAKE_PAIR_LOOP", &pair_loop);
}

fn symlink(dir: &Path, target: &str, link: &str) {
    let path = dir.join(link);
    let _ = fs::remove_file(&path);
    std::os::unix::fs::symlink(target, &path)
        .unwrap_or_else(|e| panic!("symlink {}: {e}", path.display()));
}
