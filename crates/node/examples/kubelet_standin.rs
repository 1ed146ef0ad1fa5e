//! The kubelet's side of one pod's admission, for a machine without Kubernetes
//! (`scripts/gpu/device_plugin_pod.sh`): serves `<DIR>/kubelet.sock`, waits for the device
//! plugin's registration, then asks it, as the kubelet does, for the preferred units of
//! one container of UNITS units among all the healthy ones and allocates them. Prints the
//! answer a line each: `env NAME=VALUE`, `mount CONTAINER_PATH HOST_PATH ro|rw`, and
//! `units N` (how many the plugin advertised); exit 1 with the plugin's message when
//! Allocate refuses.
//!
//!     kubelet_standin DIR UNITS

#[path = "../tests/kubelet/mod.rs"]
mod kubelet;

use std::path::PathBuf;

use cudabudget_node::api;
use kubelet::{Kubelet, allocate, connect, patiently, prefer};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, units] = &args[..] else {
        eprintln!("usage: kubelet_standin DIR UNITS");
        std::process::exit(2);
    };
    let dir = PathBuf::from(dir);
    let units: i32 = units.parse().expect("UNITS: a number");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let code = runtime.block_on(async move {
        let mut kubelet = Kubelet::start(&dir);
        let registration = kubelet.registration(|| None).await;
        println!(
            "registered {} {}",
            registration.resource_name, registration.endpoint
        );
        let mut client = connect(dir.join(&registration.endpoint)).await;
        let mut stream = client
            .list_and_watch(api::Empty {})
            .await
            .expect("ListAndWatch")
            .into_inner();
        let list = patiently("a device list", stream.message()).await;
        let devices = list.expect("the stream").expect("a list").devices;
        println!("units {}", devices.len());
        let healthy: Vec<String> = devices
            .into_iter()
            .filter(|d| d.health == "Healthy")
            .map(|d| d.id)
            .collect();
        let mut chosen = prefer(&mut client, &healthy, units).await;
        if chosen.is_empty() {
            // No preference: the kubelet takes any, as here.
            chosen = healthy.into_iter().take(units as usize).collect();
        }
        match allocate(&mut client, &chosen).await {
            Ok(answer) => {
                let mut envs: Vec<_> = answer.envs.into_iter().collect();
                envs.sort();
                for (name, value) in envs {
                    println!("env {name}={value}");
                }
                for mount in answer.mounts {
                    let mode = if mount.read_only { "ro" } else { "rw" };
                    println!("mount {} {} {mode}", mount.container_path, mount.host_path);
                }
                0
            }
            Err(status) => {
                eprintln!("refused: {}", status.message());
                1
            }
        }
    });
    std::process::exit(code);
}
