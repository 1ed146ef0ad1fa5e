//! The `DevicePlugin` service the kubelet calls on our socket.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::places::Places;
use super::units::{Grant, Layout};
use crate::api;

/// What one server (one registration with one kubelet) answers from.
#[derive(Clone)]
pub struct Plugin {
    pub layout: Arc<Layout>,
    pub places: Arc<Places>,
    /// The device list, re-sent to every ListAndWatch when it changes.
    pub devices: watch::Receiver<Vec<api::Device>>,
    /// The resource's name (`--resource`), for messages.
    pub resource: Arc<str>,
    /// Set when this server stops: its ListAndWatch streams end, so that a graceful
    /// shutdown does not wait for the kubelet to hang up.
    pub stopping: watch::Receiver<bool>,
}

impl Plugin {
    /// What a container given `ids` needs: its GPU, its budget, the library and its
    /// private runtime directory.
    fn container(&self, ids: &[String]) -> Result<api::ContainerAllocateResponse, Status> {
        let Grant { uuid, units, bytes } = self.layout.grant(ids).map_err(|e| {
            Status::invalid_argument(format!("cudabudget device plugin, {}: {e}", self.resource))
        })?;
        let private = self.places.private_dir(ids).map_err(|e| {
            Status::internal(format!(
                "cudabudget device plugin: cannot prepare the container's runtime directory: {e}"
            ))
        })?;
        eprintln!(
            "cudabudget-node device-plugin: {units} units of {} ({bytes} bytes) on {uuid}, \
             runtime directory {}",
            self.resource,
            private.display()
        );
        let places = &self.places;
        let envs: HashMap<String, String> = [
            ("NVIDIA_VISIBLE_DEVICES", uuid.clone()),
            ("CUDA_VISIBLE_DEVICES", uuid),
            (cudabudget_spec::config::LIMIT, bytes.to_string()),
            ("LD_PRELOAD", places.library_in_container()),
            (
                cudabudget_spec::config::RUNTIME_DIR,
                places.records_in_container(),
            ),
            (cudabudget_spec::config::JOB_DIR, places.jobs_in_container()),
            ("CUDABUDGET_SCOPE", "job:container".to_string()),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_string(), value))
        .collect();
        let mounts = vec![
            api::Mount {
                container_path: places.library_mount.clone(),
                host_path: places.library_dir.display().to_string(),
                read_only: true,
            },
            api::Mount {
                container_path: places.runtime_mount.clone(),
                host_path: private.display().to_string(),
                read_only: false,
            },
        ];
        Ok(api::ContainerAllocateResponse {
            envs,
            mounts,
            ..Default::default()
        })
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl api::device_plugin_server::DevicePlugin for Plugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(super::options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<DeviceStream>, Status> {
        // A task per stream: the current list, then each new one, until this server
        // stops or the kubelet hangs up.
        let mut stopping = self.stopping.clone();
        let mut devices = self.devices.clone();
        let (sender, receiver) = mpsc::channel(1);
        tokio::spawn(async move {
            loop {
                let list = devices.borrow_and_update().clone();
                let response = api::ListAndWatchResponse { devices: list };
                if sender.send(Ok(response)).await.is_err() {
                    return;
                }
                tokio::select! {
                    changed = devices.changed() => if changed.is_err() { return },
                    _ = stopping.wait_for(|stop| *stop) => return,
                    _ = sender.closed() => return,
                }
            }
        });
        let stream = ReceiverStream::new(receiver);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|c| api::ContainerPreferredAllocationResponse {
                device_i_ds: self.layout.prefer(
                    &c.available_device_i_ds,
                    &c.must_include_device_i_ds,
                    usize::try_from(c.allocation_size).unwrap_or(0),
                ),
            })
            .collect();
        Ok(Response::new(api::PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|c| self.container(&c.devices_ids))
            .collect::<Result<Vec<_>, Status>>()
            .inspect_err(|e| {
                eprintln!("cudabudget-node device-plugin: refused: {}", e.message())
            })?;
        Ok(Response::new(api::AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}
