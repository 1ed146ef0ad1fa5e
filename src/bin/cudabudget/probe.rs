//! The children `run`, `install` and `doctor` start to try the library: hidden commands
//! of this binary, so the check needs nothing but the binary itself.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use crate::library;
use cudabudget_cli_common::gpu::Cuda;
use cudabudget_cli_common::tell::Refusal;

#[derive(Args)]
pub struct PreloadArgs {
    /// The library that must be mapped into this process.
    library: PathBuf,
}

/// Prints "loaded" when `library` is mapped into this process (the loader preloaded
/// it), "not loaded" (exit 1) otherwise.
pub fn preload(args: PreloadArgs) -> Result<ExitCode, Refusal> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let loaded = maps.lines().any(|line| {
        // address perms offset dev inode path
        let mut fields = line.split_ascii_whitespace();
        let inode = fields.nth(4);
        let path = fields.next();
        matches!((inode, path), (Some(inode), Some(path))
            if inode != "0" && library::same_file(std::path::Path::new(path), &args.library))
    });
    if loaded {
        println!("loaded");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("not loaded");
        Ok(ExitCode::from(1))
    }
}

#[derive(Args)]
pub struct AllocArgs {
    /// Bytes to ask for on device 0.
    #[arg(long, default_value_t = 256 << 20)]
    request: u64,
}

/// What a program under the library sees: device 0's memory view and the answer to one
/// allocation, as `probe init=RC total=BYTES alloc=RC`.
pub fn alloc(args: AllocArgs) -> Result<ExitCode, Refusal> {
    let cuda = match Cuda::open() {
        Ok(cuda) => cuda,
        Err(reason) => {
            println!("probe open=-1 reason={reason:?}");
            return Ok(ExitCode::from(1));
        }
    };
    if let Err(rc) = cuda.init().and_then(|()| cuda.activate(0)) {
        println!("probe init={rc}");
        return Ok(ExitCode::from(1));
    }
    let total = cuda.mem_info().map(|(_, total)| total).unwrap_or(0);
    let rc = cuda.alloc_and_free(args.request);
    cuda.release(0);
    println!("probe init=0 total={total} alloc={rc}");
    Ok(ExitCode::SUCCESS)
}
