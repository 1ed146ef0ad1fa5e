//! A kubelet stand-in: the kubelet's side of the device plugin API (v1beta1) over Unix
//! sockets, as the kubelet speaks it. Used by `tests/device_plugin.rs` and by
//! `examples/kubelet_standin.rs` (for `scripts/gpu/device_plugin_pod.sh`).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use cudabudget_node::api;
use cudabudget_node::api::device_plugin_client::DevicePluginClient;
use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Endpoint, Server, Uri};
use tonic::{Request, Response, Status};

/// How long a step may take before the test fails (a guard, not a measurement).
pub const PATIENCE: Duration = Duration::from_secs(60);

pub async fn patiently<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing after {PATIENCE:?}"))
}

/// The kubelet's Registration service: each Register goes to the test.
struct Registrations(mpsc::UnboundedSender<api::RegisterRequest>);

#[tonic::async_trait]
impl api::registration_server::Registration for Registrations {
    async fn register(
        &self,
        request: Request<api::RegisterRequest>,
    ) -> Result<Response<api::Empty>, Status> {
        let _ = self.0.send(request.into_inner());
        Ok(Response::new(api::Empty {}))
    }
}

/// A kubelet stand-in serving `<dir>/kubelet.sock`.
pub struct Kubelet {
    registrations: mpsc::UnboundedReceiver<api::RegisterRequest>,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

impl Kubelet {
    pub fn start(dir: &Path) -> Kubelet {
        let listener = UnixListener::bind(dir.join("kubelet.sock")).expect("the kubelet's socket");
        let (sender, registrations) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            Server::builder()
                .add_service(api::registration_server::RegistrationServer::new(
                    Registrations(sender),
                ))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = stopped.await;
                })
                .await
                .expect("the kubelet stand-in serves");
        });
        Kubelet {
            registrations,
            stop: Some(stop),
            server,
        }
    }

    /// The plugin's next registration. `exited` is asked every 50 ms whether the plugin
    /// has ended (and why): then the wait fails at once with that.
    pub async fn registration(
        &mut self,
        mut exited: impl FnMut() -> Option<String>,
    ) -> api::RegisterRequest {
        let registered = async {
            loop {
                tokio::select! {
                    registration = self.registrations.recv() => {
                        return registration.expect("the stand-in is serving");
                    }
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {
                        if let Some(why) = exited() {
                            panic!("the plugin exited: {why}");
                        }
                    }
                }
            }
        };
        patiently("the plugin's registration", registered).await
    }

    pub async fn stop(mut self) {
        let _ = self.stop.take().expect("running").send(());
        patiently("the stand-in's end", self.server)
            .await
            .expect("it ended");
    }
}

/// Connects to a plugin's socket as the kubelet does.
pub async fn connect(socket: PathBuf) -> DevicePluginClient<Channel> {
    let channel = Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { UnixStream::connect(socket).await.map(TokioIo::new) }
        }))
        .await
        .expect("the plugin's socket answers");
    DevicePluginClient::new(channel)
}

/// The kubelet's GetPreferredAllocation for one container of `size` units.
pub async fn prefer(
    client: &mut DevicePluginClient<Channel>,
    available: &[String],
    size: i32,
) -> Vec<String> {
    let request = api::PreferredAllocationRequest {
        container_requests: vec![api::ContainerPreferredAllocationRequest {
            available_device_i_ds: available.to_vec(),
            must_include_device_i_ds: Vec::new(),
            allocation_size: size,
        }],
    };
    let response = client.get_preferred_allocation(request).await;
    let mut containers = response.expect("a preferred allocation").into_inner();
    containers.container_responses.remove(0).device_i_ds
}

/// The kubelet's Allocate for one container given `ids`.
pub async fn allocate(
    client: &mut DevicePluginClient<Channel>,
    ids: &[String],
) -> Result<api::ContainerAllocateResponse, Status> {
    let request = api::AllocateRequest {
        container_requests: vec![api::ContainerAllocateRequest {
            devices_ids: ids.to_vec(),
        }],
    };
    let mut response = client.allocate(request).await?.into_inner();
    Ok(response.container_responses.remove(0))
}
