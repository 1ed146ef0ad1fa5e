//! `cudabudget-node device-plugin`: the kubelet's device plugin for `cudabudget.io/memory`.
//!
//! It advertises each GPU's memory less a reserve as units (one a GiB by default), each
//! unit a device of the kubelet's tied to one GPU, so the scheduler counts budgets and a
//! namespace's ResourceQuota caps them. `Allocate` answers what a container given units
//! needs: its GPU, its budget, the library and a private runtime directory.
//!
//! Its life: serve `<kubelet-dir>/cudabudget.sock`, register on `<kubelet-dir>/kubelet.sock`,
//! then watch both sockets; when the kubelet restarts (its socket is made anew, and it
//! removes ours), serve a new socket and register again. SIGTERM or SIGINT ends it.

mod places;
mod service;
pub mod units;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Endpoint, Server, Uri};

use crate::api;
use crate::nvml::Nvml;
use places::Places;
use service::Plugin;
use units::{Layout, human};

const LOG: &str = "cudabudget-node device-plugin";

/// `cudabudget-node device-plugin`'s options.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The size of one unit of the resource (a Kubernetes quantity).
    #[arg(long, value_name = "QUANTITY", default_value = "1Gi", value_parser = bytes)]
    unit: u64,

    /// What each GPU keeps out of the units (contexts, the driver, other users).
    #[arg(long, value_name = "QUANTITY", default_value = "2Gi", value_parser = reserve)]
    reserve: u64,

    /// The kubelet's device plugin directory (kubelet.sock is there; ours goes there).
    #[arg(
        long = "kubelet-dir",
        value_name = "DIR",
        default_value = "/var/lib/kubelet/device-plugins"
    )]
    kubelet_dir: PathBuf,

    /// The extended resource advertised.
    #[arg(long, value_name = "NAME", default_value = "cudabudget.io/memory")]
    resource: String,

    /// The node's library directory (the installer's <libraryDir>/current), mounted
    /// read-only into each container given units: a path on the node (the plugin does
    /// not read it).
    #[arg(
        long = "library-dir",
        value_name = "DIR",
        default_value = "/opt/cudabudget/current"
    )]
    library_dir: PathBuf,

    /// Where containers see the library directory; LD_PRELOAD names libcudabudget.so there.
    #[arg(
        long = "library-mount",
        value_name = "DIR",
        default_value = "/opt/cudabudget"
    )]
    library_mount: String,

    /// The root of the containers' private runtime directories (root's, 0700). The
    /// kubelet mounts what the plugin makes there, so it must be the same path on the
    /// node as where the plugin sees it.
    #[arg(
        long = "runtime-dir",
        value_name = "DIR",
        default_value = "/run/cudabudget/device-plugin"
    )]
    runtime_dir: PathBuf,

    /// Where a container sees its private runtime directory (records/ and jobs/ in it).
    #[arg(
        long = "runtime-mount",
        value_name = "DIR",
        default_value = "/run/cudabudget"
    )]
    runtime_mount: String,

    /// How often the GPUs' health and the kubelet's socket are looked at, in milliseconds.
    #[arg(long = "poll-ms", value_name = "MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(10..=60_000))]
    poll_ms: u64,
}

/// A quantity of bytes ("2Gi", "512Mi", "0"); no percentage.
fn reserve(value: &str) -> Result<u64, String> {
    match cudabudget_spec::quantity::parse_limit(value) {
        Ok(cudabudget_spec::quantity::Limit::Bytes(bytes)) => Ok(bytes),
        Ok(_) => Err("a percentage is not a size here; write e.g. 1Gi".to_string()),
        Err(e) => Err(e.reason),
    }
}

/// A quantity of bytes more than zero.
fn bytes(value: &str) -> Result<u64, String> {
    match reserve(value)? {
        0 => Err("must be more than 0".to_string()),
        bytes => Ok(bytes),
    }
}

/// A directory given as an absolute path of plain names.
fn absolute(option: &str, value: &str) -> Result<String, String> {
    let trimmed = value.trim_end_matches('/');
    let plain = value.starts_with('/')
        && !trimmed.is_empty()
        && trimmed[1..]
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..");
    if plain {
        Ok(trimmed.to_string())
    } else {
        Err(format!(
            "{option} {value:?}: use an absolute directory, e.g. /opt/cudabudget"
        ))
    }
}

/// What this plugin tells the kubelet about itself.
fn options() -> api::DevicePluginOptions {
    api::DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

/// The socket's file name in the kubelet's directory.
const SOCKET: &str = "cudabudget.sock";

pub fn run(args: Args) -> Result<(), String> {
    let places = Places {
        library_dir: args.library_dir.clone(),
        library_mount: absolute("--library-mount", &args.library_mount)?,
        runtime_dir: args.runtime_dir.clone(),
        runtime_mount: absolute("--runtime-mount", &args.runtime_mount)?,
    };
    places.prepare().map_err(|e| {
        format!(
            "cannot make the runtime directory {}: {e}",
            args.runtime_dir.display()
        )
    })?;
    let nvml = Nvml::open()?;
    // A GPU NVML cannot answer for now has no UUID to name its units by: it is left out
    // until the plugin starts again (the DaemonSet's pod restarted).
    let gpus: Vec<_> = nvml
        .gpus()?
        .into_iter()
        .filter_map(|gpu| {
            gpu.inspect_err(|(index, e)| eprintln!("{LOG}: GPU {index} is left out: {e}"))
                .ok()
        })
        .collect();
    let layout = Layout::new(&gpus, args.unit, args.reserve);
    for gpu in &layout.gpus {
        eprintln!(
            "{LOG}: GPU {} {}: {} units of {} ({} reserved)",
            gpu.index,
            gpu.uuid,
            gpu.count,
            human(args.unit),
            human(args.reserve)
        );
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime ({e})"))?;
    runtime.block_on(serve(
        args,
        Arc::new(nvml),
        Arc::new(layout),
        Arc::new(places),
    ))
}

/// The device list, with the indexes of the GPUs NVML does not answer for.
fn devices(layout: &Layout, unhealthy: &BTreeSet<u32>) -> Vec<api::Device> {
    layout
        .ids()
        .map(|(index, id)| api::Device {
            id,
            health: if unhealthy.contains(&index) {
                "Unhealthy"
            } else {
                "Healthy"
            }
            .to_string(),
            topology: None,
        })
        .collect()
}

/// Asks NVML for each advertised GPU's health every `poll`, and sends the device list
/// when it changed.
async fn watch_health(
    nvml: Arc<Nvml>,
    layout: Arc<Layout>,
    poll: Duration,
    sender: watch::Sender<Vec<api::Device>>,
) {
    let mut unhealthy = BTreeSet::new();
    loop {
        tokio::time::sleep(poll).await;
        let mut now = BTreeSet::new();
        for gpu in &layout.gpus {
            let answer = nvml.health(gpu.index);
            match (&answer, unhealthy.contains(&gpu.index)) {
                (Ok(()), true) => {
                    eprintln!("{LOG}: GPU {} {} is healthy again", gpu.index, gpu.uuid)
                }
                (Err(e), false) => {
                    eprintln!("{LOG}: GPU {} {} is unhealthy: {e}", gpu.index, gpu.uuid)
                }
                _ => {}
            }
            if answer.is_err() {
                now.insert(gpu.index);
            }
        }
        if now != unhealthy {
            sender.send_replace(devices(&layout, &now));
            unhealthy = now;
        }
    }
}

/// Which file a socket path is: its inode and change time (a file made anew may get the
/// inode number of the one removed just before it, never the same change time too), or
/// None when it is gone.
fn inode(path: &Path) -> Option<(u64, i64, i64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|meta| (meta.ino(), meta.ctime(), meta.ctime_nsec()))
}

/// Calls the kubelet's `Registration.Register` on its socket.
async fn register(kubelet: &Path, resource: &str) -> Result<(), String> {
    let path = kubelet.to_path_buf();
    let channel = Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|e| format!("cannot reach the kubelet at {}: {e}", kubelet.display()))?;
    api::registration_client::RegistrationClient::new(channel)
        .register(api::RegisterRequest {
            version: "v1beta1".to_string(),
            endpoint: SOCKET.to_string(),
            resource_name: resource.to_string(),
            options: Some(options()),
        })
        .await
        .map_err(|status| format!("the kubelet refused the registration: {}", status.message()))?;
    Ok(())
}

async fn serve(
    args: Args,
    nvml: Arc<Nvml>,
    layout: Arc<Layout>,
    places: Arc<Places>,
) -> Result<(), String> {
    let poll = Duration::from_millis(args.poll_ms);
    let (devices_sender, devices_receiver) = watch::channel(devices(&layout, &BTreeSet::new()));
    tokio::spawn(watch_health(nvml, layout.clone(), poll, devices_sender));

    let (quit_sender, mut quit) = watch::channel(false);
    let mut terminate = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
        quit_sender.send_replace(true);
    });

    let kubelet = args.kubelet_dir.join("kubelet.sock");
    let ours = args.kubelet_dir.join(SOCKET);
    let mut waiting_said = false;
    loop {
        // Wait for the kubelet.
        if inode(&kubelet).is_none() {
            if !waiting_said {
                eprintln!(
                    "{LOG}: waiting for the kubelet's socket {}",
                    kubelet.display()
                );
                waiting_said = true;
            }
            tokio::select! {
                _ = tokio::time::sleep(poll) => continue,
                _ = quit.wait_for(|q| *q) => return Ok(()),
            }
        }
        waiting_said = false;
        let kubelet_inode = inode(&kubelet);

        // Serve a fresh socket.
        match std::fs::remove_file(&ours) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(format!(
                    "cannot remove the old socket {}: {e}",
                    ours.display()
                ));
            }
        }
        let listener = UnixListener::bind(&ours)
            .map_err(|e| format!("cannot listen on {}: {e}", ours.display()))?;
        let our_inode = inode(&ours);
        let (stop_sender, stop) = watch::channel(false);
        let plugin = Plugin {
            layout: layout.clone(),
            places: places.clone(),
            devices: devices_receiver.clone(),
            resource: Arc::from(args.resource.as_str()),
            stopping: stop.clone(),
        };
        let mut server_stop = stop;
        let server = tokio::spawn(
            Server::builder()
                .add_service(api::device_plugin_server::DevicePluginServer::new(plugin))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move {
                    let _ = server_stop.wait_for(|s| *s).await;
                }),
        );

        let outcome = match register(&kubelet, &args.resource).await {
            Ok(()) => {
                eprintln!(
                    "{LOG}: registered {} on {} with the kubelet",
                    args.resource,
                    ours.display()
                );
                // Watch for a kubelet restart: its socket made anew, or ours removed.
                loop {
                    tokio::select! {
                        _ = tokio::time::sleep(poll) => {
                            if inode(&kubelet) != kubelet_inode || inode(&ours) != our_inode {
                                eprintln!("{LOG}: the kubelet restarted; registering again");
                                break false;
                            }
                        }
                        _ = quit.wait_for(|q| *q) => break true,
                    }
                }
            }
            Err(e) => {
                eprintln!("{LOG}: {e}; trying again");
                tokio::select! {
                    _ = tokio::time::sleep(poll) => false,
                    _ = quit.wait_for(|q| *q) => true,
                }
            }
        };
        stop_sender.send_replace(true);
        match tokio::time::timeout(Duration::from_secs(5), server).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => eprintln!("{LOG}: the server stopped: {e}"),
            Ok(Err(e)) => eprintln!("{LOG}: the server stopped: {e}"),
            Err(_) => eprintln!("{LOG}: the server did not stop in 5 s; leaving it"),
        }
        // Remove our socket only if it is still the one this server made.
        if inode(&ours) == our_inode {
            let _ = std::fs::remove_file(&ours);
        }
        if outcome {
            eprintln!("{LOG}: stopped");
            return Ok(());
        }
    }
}
