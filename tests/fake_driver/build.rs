//! Builds the test fixtures (a fake `libcuda.so.1`, a fake `libnvidia-ml.so.1`, the C test
//! clients, a third-party `RTLD_NEXT` preload and the two C programs of the benchmarks)
//! into `$OUT_DIR/fake/` and hands their paths to `src/lib.rs` (`cargo:rustc-env`).
//!
//! This crate is a dev-dependency of cudabudget, so only test, bench and
//! `clippy --all-targets` builds come here; `cargo build` needs no C compiler.
//! When a fixture does not build, the compiler's own output is printed, with the
//! command line (program and arguments, not the environment).

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const CFLAGS: &[&str] = &["-std=gnu11", "-O2", "-g", "-Wall", "-Wextra", "-Werror"];

/// The sources, relative to this crate's directory (`tests/fake_driver/`).
const SOURCES: &[&str] = &[
    "fake_cuda.c",
    "fake_cuda_api.h",
    "fake_nvml.c",
    "client.c",
    "prop_client.c",
    "thirdparty.c",
    "../../scripts/gpu/bench/driver_bench.c",
    "../../benches/pair_loop.c",
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for s in SOURCES {
        println!("cargo:rerun-if-changed={s}");
    }

    let src = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR")).join("fake");
    fs::create_dir_all(&out).expect("create OUT_DIR/fake");

    let compiler = match cc::Build::new().cargo_metadata(false).try_get_compiler() {
        Ok(compiler) => compiler,
        Err(e) => fail(&format!(
            "no C compiler for the test fixtures ({e}); install one (gcc or clang) or \
             name it in CC. Only tests and benches need it: `cargo build` does not."
        )),
    };
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
        run(&mut cmd, output);
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

/// Runs one compiler command; on failure prints what the compiler said and stops.
fn run(cmd: &mut Command, output: &str) {
    let line = command_line(cmd);
    let result = match cmd.output() {
        Ok(result) => result,
        Err(e) => fail(&format!(
            "cannot run the C compiler for the test fixture {output}: {e}\n  command: {line}\n\
             Install a C compiler (gcc or clang) or name one in CC. Only tests and benches \
             need it: `cargo build` does not."
        )),
    };
    if !result.status.success() {
        let said = String::from_utf8_lossy(&result.stderr);
        let said_out = String::from_utf8_lossy(&result.stdout);
        fail(&format!(
            "building the test fixture {output} failed ({}):\n  command: {line}\n\
             --- compiler output ---\n{said_out}{said}--- end of compiler output ---",
            result.status
        ));
    }
}

/// The program and its arguments, shell-quoted where needed; never the environment
/// (`Command`'s `Debug` would print every variable the `cc` crate passes on).
fn command_line(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| {
            let a = a.to_string_lossy();
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=,+:@".contains(c))
            {
                a.into_owned()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Prints `message` (cargo shows a failed build script's stderr) and exits with an error,
/// without a panic's backtrace noise.
fn fail(message: &str) -> ! {
    eprintln!("error: {message}");
    std::process::exit(1);
}

fn symlink(dir: &Path, target: &str, link: &str) {
    let path = dir.join(link);
    let _ = fs::remove_file(&path);
    std::os::unix::fs::symlink(target, &path)
        .unwrap_or_else(|e| panic!("symlink {}: {e}", path.display()));
}
