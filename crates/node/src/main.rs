//! `cudabudget-node`: cudabudget's services for cluster nodes, apart from the user's
//! `cudabudget` so that installing that never compiles gRPC. One subcommand each.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cudabudget-node",
    version,
    about = "cudabudget's node services for clusters"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The kubelet's device plugin: advertises cudabudget.io/memory, each unit tied to
    /// one GPU, and answers Allocate with the GPU, the budget and the library.
    DevicePlugin(cudabudget_node::device_plugin::Args),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::DevicePlugin(args) => cudabudget_node::device_plugin::run(args),
    };
    if let Err(e) = result {
        eprintln!("cudabudget-node: {e}");
        std::process::exit(1);
    }
}
