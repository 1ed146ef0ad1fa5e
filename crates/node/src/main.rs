//! `cudabudget-node`: cudabudget's services for cluster nodes, apart from the user's
//! `cudabudget` so that installing that never compiles Kubernetes types, TLS, HTTP or
//! gRPC. One subcommand each; `cudabudget webhook|exporter …` run these through
//! `exec`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use cudabudget_cli_common::preload::without_own_preload;
use cudabudget_cli_common::tell::{self, say};
use cudabudget_node::{exporter, webhook};

#[derive(Parser)]
#[command(
    name = "cudabudget-node",
    version,
    about = "cudabudget's node services for clusters",
    after_help = "Examples:
  cudabudget-node device-plugin
  cudabudget-node webhook --listen 0.0.0.0:8443 --tls-cert tls.crt --tls-key tls.key
  cudabudget-node exporter --listen 0.0.0.0:9464"
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
    /// Serve the Kubernetes admission webhook that budgets annotated pods (/mutate).
    #[command(after_help = webhook::AFTER_HELP)]
    Webhook(webhook::WebhookArgs),
    /// Serve the budgeted processes' figures as Prometheus metrics.
    #[command(after_help = exporter::AFTER_HELP)]
    Exporter(exporter::ExporterArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return tell::clap_error(&error, tell::EXIT_USAGE),
    };
    let outcome = match cli.command {
        Command::DevicePlugin(args) => {
            return match cudabudget_node::device_plugin::run(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("cudabudget-node: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        Command::Webhook(args) => webhook::webhook(args),
        Command::Exporter(args) => {
            // It asks NVML for the GPUs' figures: never under the library.
            without_own_preload();
            exporter::exporter(args)
        }
    };
    match outcome {
        Ok(code) => code,
        Err(refusal) => {
            say(&refusal.message);
            ExitCode::from(refusal.status)
        }
    }
}
