//! cudabudget's node services: the Kubernetes device plugin, the admission webhook and
//! the Prometheus exporter, with the HTTP server and TLS the last two share. The binary
//! `cudabudget-node` dispatches to one module per service. What it shares with the
//! user's `cudabudget` (the records, the figures, the GPUs' names, how a message is
//! told) is `cudabudget-cli-common`.

/// The kubelet's device plugin API (v1beta1), generated from `proto/` by `build.rs`.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod api {
    tonic::include_proto!("v1beta1");
}

pub mod device_plugin;
pub mod exporter;
pub mod http;
pub mod nvml;
pub mod tls;
pub mod webhook;

use cudabudget_cli_common::{figures, gpu, records, tell};
