//! cudabudget's node services: the Kubernetes device plugin. The binary `cudabudget-node`
//! dispatches to one module per service.

/// The kubelet's device plugin API (v1beta1), generated from `proto/` by `build.rs`.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod api {
    tonic::include_proto!("v1beta1");
}

pub mod device_plugin;
pub mod nvml;
