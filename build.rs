//! Lets the CLI carry the library (`src/bin/cudabudget/library.rs`), so that `cargo
//! install` gives a working `cudabudget`: cargo builds the cdylib into `<profile>/deps/`
//! before it compiles the binary, and `OUT_DIR` is `<profile>/build/cudabudget-<hash>/out`.
//! `cargo check` and clippy build no cdylib: an empty stand-in keeps `include_bytes!`
//! compiling, and the CLI takes an empty copy for "none". Compiles no C.

use std::env;
use std::fs;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let Some(deps) = out.ancestors().nth(3).map(|profile| profile.join("deps")) else {
        return;
    };
    if !deps.is_dir() {
        return;
    }
    let library = deps.join("libcudabudget.so");
    if !library.exists() {
        let _ = fs::write(&library, b"");
    }
    println!("cargo:rustc-cfg=cudabudget_embed");
    println!(
        "cargo:rustc-env=CB_BUILD_EMBED_LIBRARY={}",
        library.display()
    );
}
