//! The device plugin against a kubelet stand-in that speaks the kubelet's protocol
//! (v1beta1 over Unix sockets): it serves Registration, takes the plugin's Register, and
//! calls ListAndWatch, GetPreferredAllocation and Allocate on the plugin's socket, as the
//! kubelet does. The plugin runs as a child process on the fake NVML (tests/fake_driver).

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use cudabudget_node::api;
use cudabudget_node::api::device_plugin_client::DevicePluginClient;
use tonic::transport::Channel;
use tonic::{Status, Streaming};

mod kubelet;
use kubelet::{Kubelet, connect, patiently};

const GI: u64 = 1 << 30;

/// A node: a temporary kubelet directory, a runtime root, a file of lost GPUs for the fake
/// NVML, and the plugin running on them.
struct Node {
    dir: PathBuf,
    kubelet_dir: PathBuf,
    lost: PathBuf,
    log: PathBuf,
    plugin: Child,
}

impl Node {
    /// `gpus` GPUs of `memory` bytes; the plugin started with `args`.
    fn start(name: &str, gpus: u32, memory: u64, args: &[&str]) -> Node {
        Node::start_with_lost(name, gpus, memory, args, None)
    }

    /// The same, with the GPUs `lost` (indexes, as the fake NVML reads them) lost before
    /// the plugin starts.
    fn start_with_lost(
        name: &str,
        gpus: u32,
        memory: u64,
        args: &[&str],
        lost: Option<&str>,
    ) -> Node {
        Node::spawn(name, gpus, memory, args, lost, &[])
    }

    /// The same, the plugin started by `wrapper` (a command that runs the rest).
    fn spawn(
        name: &str,
        gpus: u32,
        memory: u64,
        args: &[&str],
        lost: Option<&str>,
        wrapper: &[&str],
    ) -> Node {
        let dir =
            std::env::temp_dir().join(format!("cudabudget-node-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let kubelet_dir = dir.join("device-plugins");
        fs::create_dir_all(&kubelet_dir).expect("a kubelet directory");
        let log = dir.join("plugin.log");
        let library = dir.join("library");
        let library = match args.iter().position(|a| *a == "--library-dir") {
            Some(_) => Vec::new(),
            None => vec!["--library-dir".as_ref(), library.as_os_str()],
        };
        let lost_file = dir.join("lost-gpus");
        if let Some(lost) = lost {
            fs::write(&lost_file, lost).expect("the lost GPUs");
        }
        let lost = lost_file;
        let binary = env!("CARGO_BIN_EXE_cudabudget-node");
        let plugin = match wrapper {
            [] => Command::new(binary),
            [first, rest @ ..] => {
                let mut command = Command::new(first);
                command.args(rest).arg(binary);
                command
            }
        }
        .arg("device-plugin")
        .arg("--kubelet-dir")
        .arg(&kubelet_dir)
        .arg("--runtime-dir")
        .arg(dir.join("runtime"))
        .args(["--poll-ms", "50"])
        .args(library)
        .args(args)
        .env("LD_LIBRARY_PATH", cudabudget_fake_driver::FAKE_DRIVER_DIR)
        .env("FAKE_CUDA_DEVICES", gpus.to_string())
        .env("FAKE_CUDA_MEM", memory.to_string())
        .env("FAKE_NVML_LOST_FILE", &lost)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).expect("a log file"))
        .spawn()
        .expect("the plugin starts");
        Node {
            dir,
            kubelet_dir,
            lost,
            log,
            plugin,
        }
    }

    fn socket(&self, registration: &api::RegisterRequest) -> PathBuf {
        self.kubelet_dir.join(&registration.endpoint)
    }

    /// Whether the plugin has ended, with its status and log.
    fn exited(&mut self) -> Option<String> {
        let status = self.plugin.try_wait().expect("the plugin's state")?;
        Some(format!("{status}:\n{}", self.log()))
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.plugin.kill();
        let _ = self.plugin.wait();
        if std::thread::panicking() {
            eprintln!("the plugin's log:\n{}", self.log());
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn uuid(index: u32) -> String {
    format!("GPU-faceb00c-0000-0000-0000-0000000000{index:02x}")
}

/// How many units of each GPU (by index) are in each health, sorted.
fn health(devices: &[api::Device]) -> Vec<(u32, &str, usize)> {
    let mut counts: HashMap<(u32, &str), usize> = HashMap::new();
    for device in devices {
        let (gpu, _) = device.id.rsplit_once('-').expect("<uuid>-<k>");
        let index = (0..64)
            .find(|i| uuid(*i) == gpu)
            .expect("a GPU of the fake");
        *counts.entry((index, device.health.as_str())).or_default() += 1;
    }
    let mut counts: Vec<_> = counts.into_iter().map(|((i, h), n)| (i, h, n)).collect();
    counts.sort();
    counts
}

/// The plugin registered with a kubelet stand-in, a client on its socket, and its
/// device list as ListAndWatch streams it.
struct Session {
    node: Node,
    kubelet: Kubelet,
    registration: api::RegisterRequest,
    client: DevicePluginClient<Channel>,
    stream: Streaming<api::ListAndWatchResponse>,
}

impl Session {
    /// `gpus` GPUs of `memory` bytes, the plugin started with `args`.
    async fn start(name: &str, gpus: u32, memory: u64, args: &[&str]) -> Session {
        let node = Node::start(name, gpus, memory, args);
        Session::on(node, None).await
    }

    /// The plugin of `node` registered with `kubelet` (a new stand-in when None).
    async fn on(mut node: Node, kubelet: Option<Kubelet>) -> Session {
        let mut kubelet = kubelet.unwrap_or_else(|| Kubelet::start(&node.kubelet_dir));
        let registration = kubelet.registration(|| node.exited()).await;
        let mut client = connect(node.socket(&registration)).await;
        let stream = client
            .list_and_watch(api::Empty {})
            .await
            .expect("ListAndWatch")
            .into_inner();
        Session {
            node,
            kubelet,
            registration,
            client,
            stream,
        }
    }

    /// Two GPUs of 80 GiB, a reserve of 2 GiB.
    async fn two_gpus(name: &str) -> Session {
        Session::start(name, 2, 80 * GI, &["--reserve", "2Gi"]).await
    }

    /// The next device list.
    async fn devices(&mut self) -> Vec<api::Device> {
        patiently("a device list", self.stream.message())
            .await
            .expect("the stream is fine")
            .expect("the stream goes on")
            .devices
    }

    async fn prefer(&mut self, available: &[String], size: i32) -> Vec<String> {
        kubelet::prefer(&mut self.client, available, size).await
    }

    async fn allocate(&mut self, ids: &[String]) -> Result<api::ContainerAllocateResponse, Status> {
        kubelet::allocate(&mut self.client, ids).await
    }
}

fn ids(devices: &[api::Device]) -> Vec<String> {
    devices.iter().map(|d| d.id.clone()).collect()
}

#[tokio::test]
async fn two_gpus_of_80_gib_with_a_2_gib_reserve_are_advertised_as_156_units_78_on_each() {
    let mut session = Session::two_gpus("advertise").await;
    let registration = &session.registration;
    assert_eq!(registration.version, "v1beta1");
    assert_eq!(registration.resource_name, "cudabudget.io/memory");
    assert_eq!(registration.endpoint, "cudabudget.sock");
    let options = registration.options.expect("options");
    assert!(options.get_preferred_allocation_available);
    let asked = session
        .client
        .get_device_plugin_options(api::Empty {})
        .await;
    assert_eq!(asked.expect("options").into_inner(), options);
    assert!(!options.pre_start_required);

    let devices = session.devices().await;
    assert_eq!(devices.len(), 156);
    assert_eq!(health(&devices), [(0, "Healthy", 78), (1, "Healthy", 78)]);
    assert!(
        devices.iter().all(|d| d.id.len() <= 63),
        "the API's limit on an ID"
    );
}

#[tokio::test]
async fn a_unit_of_512_mi_with_no_reserve_makes_160_units_of_an_80_gib_gpu() {
    let args = ["--unit", "512Mi", "--reserve", "0"];
    let mut session = Session::start("unit", 1, 80 * GI, &args).await;
    assert_eq!(health(&session.devices().await), [(0, "Healthy", 160)]);
}

#[tokio::test]
async fn a_pod_asking_20_gets_20_units_of_one_gpu_its_budget_the_library_and_a_private_runtime_directory()
 {
    let mut session = Session::two_gpus("allocate").await;
    let available = ids(&session.devices().await);
    let preferred = session.prefer(&available, 20).await;
    assert_eq!(preferred.len(), 20);
    let gpus: BTreeSet<&str> = preferred
        .iter()
        .map(|id| id.rsplit_once('-').unwrap().0)
        .collect();
    assert_eq!(gpus.len(), 1, "one GPU: {preferred:?}");
    let gpu = gpus.into_iter().next().unwrap().to_string();

    let answer = session.allocate(&preferred).await.expect("allocated");
    let env = &answer.envs;
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], gpu);
    assert_eq!(env["CUDA_VISIBLE_DEVICES"], gpu);
    assert_eq!(env["CUDABUDGET_LIMIT"], (20 * GI).to_string());
    assert_eq!(env["LD_PRELOAD"], "/opt/cudabudget/libcudabudget.so");
    assert_eq!(env["CUDABUDGET_RUNTIME_DIR"], "/run/cudabudget/records");
    assert_eq!(env["CUDABUDGET_JOB_DIR"], "/run/cudabudget/jobs");
    assert_eq!(
        env["CUDABUDGET_SCOPE"], "job:container",
        "the container's processes share it"
    );

    let mount = |answer: &api::ContainerAllocateResponse, at: &str| {
        let found = answer.mounts.iter().find(|m| m.container_path == at);
        found
            .unwrap_or_else(|| panic!("a mount at {at}: {:?}", answer.mounts))
            .clone()
    };
    let library = mount(&answer, "/opt/cudabudget");
    assert_eq!(
        Path::new(&library.host_path),
        session.node.dir.join("library")
    );
    assert!(library.read_only);
    let runtime = mount(&answer, "/run/cudabudget");
    assert!(!runtime.read_only);
    let private = PathBuf::from(&runtime.host_path);
    let root = session.node.dir.join("runtime");
    assert!(private.starts_with(root.join("alloc")), "{private:?}");
    let mode = |path: &Path| {
        fs::symlink_metadata(path)
            .expect("made")
            .permissions()
            .mode()
            & 0o7777
    };
    assert_eq!(mode(&root), 0o700, "nobody but root reaches below");
    assert_eq!(mode(&private.join("records")), 0o1777);
    assert_eq!(mode(&private.join("jobs")), 0o1777);
    assert!(
        answer.devices.is_empty(),
        "no device node: the NVIDIA runtime gives the GPU"
    );
    assert_eq!(
        answer.mounts.len(),
        2,
        "no hostPath of the pod's: {:?}",
        answer.mounts
    );

    // Another pod's units: another directory.
    let rest: Vec<String> = available
        .into_iter()
        .filter(|id| !preferred.contains(id))
        .collect();
    let other = session.prefer(&rest, 20).await;
    let other = session.allocate(&other).await.expect("allocated");
    let other = mount(&other, "/run/cudabudget");
    assert_ne!(
        other.host_path, runtime.host_path,
        "each allocation has its own directory"
    );
}

#[tokio::test]
async fn units_given_again_come_with_a_fresh_runtime_directory_whatever_the_last_pod_left() {
    let mut session = Session::two_gpus("fresh").await;
    let available = ids(&session.devices().await);
    let units = session.prefer(&available, 8).await;
    let first = session.allocate(&units).await.expect("allocated");
    let private = PathBuf::from(&first.mounts[1].host_path);
    assert_eq!(first.mounts[1].container_path, "/run/cudabudget");

    // The first pod, root in its container, leaves a ledger and swaps records/ for a
    // link to a directory of the node's.
    let victim = session.node.dir.join("victim");
    fs::create_dir(&victim).unwrap();
    fs::set_permissions(&victim, fs::Permissions::from_mode(0o700)).unwrap();
    fs::write(
        private.join("jobs").join("planted"),
        "a ledger of the last pod",
    )
    .unwrap();
    fs::remove_dir(private.join("records")).unwrap();
    std::os::unix::fs::symlink(&victim, private.join("records")).unwrap();

    // The kubelet gives the same units to the next pod.
    let second = session.allocate(&units).await.expect("allocated again");
    assert_eq!(second.mounts[1].host_path, first.mounts[1].host_path);
    assert!(
        !private.join("jobs").join("planted").exists(),
        "nothing of the last pod's"
    );
    let records = fs::symlink_metadata(private.join("records")).unwrap();
    assert!(records.is_dir(), "a directory again, not the link");
    assert_eq!(records.permissions().mode() & 0o7777, 0o1777);
    let victim_mode = fs::metadata(&victim).unwrap().permissions().mode() & 0o7777;
    assert_eq!(victim_mode, 0o700, "the link's target is untouched");
}

#[tokio::test]
async fn the_plugin_as_the_chart_runs_it_empties_what_a_pods_users_left() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !Path::new("/usr/bin/setpriv").exists() {
        // To the real standard error: the harness would swallow eprintln! of a test
        // that passes, and a skip must be seen.
        let _ = writeln!(
            std::io::stderr().lock(),
            "skipped the_plugin_as_the_chart_runs_it_empties_what_a_pods_users_left: \
             needs root and setpriv (CI has both)"
        );
        return;
    }
    // Root with DAC_OVERRIDE only, as the chart's securityContext has it.
    let wrapper = ["setpriv", "--bounding-set=-all,+dac_override", "--"];
    let node = Node::spawn("chart-caps", 2, 80 * GI, &[], None, &wrapper);
    let mut session = Session::on(node, None).await;
    let available = ids(&session.devices().await);
    let units = session.prefer(&available, 4).await;
    let first = session.allocate(&units).await.expect("allocated");
    let private = PathBuf::from(&first.mounts[1].host_path);

    // A user of the pod (uid 1000) left its own directory, 0700, with a record in it.
    let users = private.join("records").join("cudabudget-1000");
    fs::create_dir(&users).unwrap();
    fs::write(users.join("record"), "a record").unwrap();
    std::os::unix::fs::chown(users.join("record"), Some(1000), Some(1000)).unwrap();
    std::os::unix::fs::chown(&users, Some(1000), Some(1000)).unwrap();
    fs::set_permissions(&users, fs::Permissions::from_mode(0o700)).unwrap();

    session.allocate(&units).await.expect("allocated again");
    assert!(!users.exists(), "emptied for the next pod");
    let alloc = session.node.dir.join("runtime").join("alloc");
    let left: Vec<_> = fs::read_dir(&alloc)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|name| name.to_string_lossy().starts_with(".stale"))
        .collect();
    assert!(
        left.is_empty(),
        "nothing left behind: {left:?}\n{}",
        session.node.log()
    );
}

#[tokio::test]
async fn a_pod_asking_79_where_each_gpu_has_60_free_is_refused_with_a_message() {
    let mut session = Session::two_gpus("refuse").await;
    let mut available = ids(&session.devices().await);
    // Two pods of 18 first, one on each GPU, as the kubelet would place them.
    for gpu in [uuid(0), uuid(1)] {
        let on_gpu: Vec<String> = available
            .iter()
            .filter(|id| id.starts_with(&gpu))
            .cloned()
            .collect();
        let chosen = session.prefer(&on_gpu, 18).await;
        session.allocate(&chosen).await.expect("18 fit");
        available.retain(|id| !chosen.contains(id));
    }
    assert_eq!(available.len(), 120);

    // 79: no preference fits, the kubelet chooses any 79, and Allocate refuses them.
    assert!(
        session.prefer(&available, 79).await.is_empty(),
        "no one GPU holds 79"
    );
    let chosen: Vec<String> = available.iter().take(79).cloned().collect();
    let refusal = session.allocate(&chosen).await.expect_err("refused");
    assert_eq!(refusal.code(), tonic::Code::InvalidArgument);
    let message = refusal.message();
    assert!(
        message
            .contains("cudabudget.io/memory: the 79 units given to this container are on 2 GPUs")
            && message.contains("a container's budget must be on one GPU"),
        "{message}"
    );

    // And an ID that is none of ours.
    let refusal = session
        .allocate(&["GPU-other-0".to_string()])
        .await
        .expect_err("refused");
    let message = refusal.message();
    assert!(
        message.contains("\"GPU-other-0\" is not a unit of this node's GPUs"),
        "{message}"
    );
}

#[tokio::test]
async fn a_lost_gpu_turns_its_units_unhealthy_until_it_answers_again() {
    let mut session = Session::two_gpus("lost").await;
    assert_eq!(
        health(&session.devices().await),
        [(0, "Healthy", 78), (1, "Healthy", 78)]
    );

    fs::write(&session.node.lost, "1\n").expect("GPU 1 lost");
    assert_eq!(
        health(&session.devices().await),
        [(0, "Healthy", 78), (1, "Unhealthy", 78)]
    );
    let log = session.node.log();
    assert!(
        log.contains("is unhealthy: nvmlDeviceGetMemoryInfo: GPU is lost"),
        "{log}"
    );

    fs::remove_file(&session.node.lost).expect("GPU 1 back");
    assert_eq!(
        health(&session.devices().await),
        [(0, "Healthy", 78), (1, "Healthy", 78)]
    );
}

#[tokio::test]
async fn a_gpu_lost_before_the_plugin_starts_is_left_out_and_the_others_are_served() {
    let node = Node::start_with_lost(
        "lost-at-start",
        2,
        80 * GI,
        &["--reserve", "2Gi"],
        Some("0"),
    );
    let mut session = Session::on(node, None).await;
    assert_eq!(health(&session.devices().await), [(1, "Healthy", 78)]);
    let node = &session.node;
    let log = node.log();
    assert!(
        log.contains("GPU 0 is left out: nvmlDeviceGetUUID: GPU is lost"),
        "{log}"
    );
}

#[tokio::test]
async fn the_plugin_registers_again_when_the_kubelet_restarts() {
    let Session { node, kubelet, .. } = Session::two_gpus("restart").await;
    // The kubelet restarts: its socket goes and is made anew (here it leaves the plugin's
    // socket, so the plugin must notice the new kubelet.sock itself).
    kubelet.stop().await;
    fs::remove_file(node.kubelet_dir.join("kubelet.sock")).expect("the old socket removed");
    let kubelet = Kubelet::start(&node.kubelet_dir);
    let mut session = Session::on(node, Some(kubelet)).await;
    assert_eq!(session.devices().await.len(), 156);

    // And when the kubelet removes the plugin's socket, as it does at its start.
    let Session {
        mut node,
        mut kubelet,
        registration,
        ..
    } = session;
    fs::remove_file(node.socket(&registration)).expect("the plugin's socket removed");
    let registration = kubelet.registration(|| node.exited()).await;
    let mut client = connect(node.socket(&registration)).await;
    let options = client
        .get_device_plugin_options(api::Empty {})
        .await
        .expect("served again");
    assert!(options.into_inner().get_preferred_allocation_available);
}

#[tokio::test]
async fn sigterm_ends_the_plugin_and_removes_its_socket() {
    let Session { mut node, .. } = Session::two_gpus("sigterm").await;
    // SAFETY: kill with the pid of our own child, still running (not yet waited for).
    let rc = unsafe { libc::kill(node.plugin.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(rc, 0);
    let status = node.plugin.wait().expect("it ends");
    assert!(status.success(), "{status:?}: {}", node.log());
    assert!(
        !node.kubelet_dir.join("cudabudget.sock").exists(),
        "its socket is removed"
    );
}

/// The library under test: `cargo test` builds it beside the test executables.
fn library() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    exe.parent().expect("deps/").join("libcudabudget.so")
}

/// `path` as the container sees it, on the host: under the mount that holds it.
fn on_host(mounts: &[api::Mount], path: &str) -> String {
    let mount = mounts
        .iter()
        .find(|m| Path::new(path).starts_with(&m.container_path))
        .unwrap_or_else(|| panic!("{path} is in no mount of {mounts:?}"));
    let rest = Path::new(path).strip_prefix(&mount.container_path).unwrap();
    Path::new(&mount.host_path).join(rest).display().to_string()
}

#[tokio::test]
async fn a_process_started_as_allocate_says_sees_its_units_as_the_device_and_is_held_to_them() {
    let library = library();
    let library_dir = library.parent().unwrap().to_str().unwrap().to_string();
    let args = ["--reserve", "2Gi", "--library-dir", &library_dir];
    let mut session = Session::start("process", 2, 80 * GI, &args).await;
    let available = ids(&session.devices().await);
    let on_gpu_1: Vec<String> = available
        .into_iter()
        .filter(|id| id.starts_with(&uuid(1)))
        .collect();
    let preferred = session.prefer(&on_gpu_1, 20).await;
    let answer = session.allocate(&preferred).await.expect("allocated");

    // The container's environment, its paths on the host where the mounts put them.
    let mut client = Command::new(cudabudget_fake_driver::FAKE_CLIENT);
    client
        .args(["gpa", "info", "alloc:19Gi", "alloc:2Gi"])
        .env_clear()
        .env("LD_LIBRARY_PATH", cudabudget_fake_driver::FAKE_DRIVER_DIR)
        .env("FAKE_CUDA_DEVICES", "2")
        .env("FAKE_CUDA_MEM", (80 * GI).to_string())
        .env("HOME", session.node.dir.join("home"));
    for (name, value) in &answer.envs {
        let value = match name.as_str() {
            "LD_PRELOAD" | "CUDABUDGET_RUNTIME_DIR" | "CUDABUDGET_JOB_DIR" => {
                on_host(&answer.mounts, value)
            }
            _ => value.clone(),
        };
        client.env(name, value);
    }
    let output = client.output().expect("the client runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let line = |op: &str| {
        stdout
            .lines()
            .filter(|l| l.starts_with(&format!("{op} ")))
            .map(String::from)
            .collect::<Vec<_>>()
    };
    let info = line("info");
    assert_eq!(info.len(), 1, "{stdout}{stderr}");
    assert!(
        info[0].contains(&format!("total={}", 20 * GI)),
        "the budget is the device: {stdout}{stderr}"
    );
    let allocs = line("alloc");
    assert!(
        allocs[0].starts_with("alloc rc=0"),
        "19 GiB fit in 20: {stdout}{stderr}"
    );
    assert!(
        allocs[1].starts_with("alloc rc=2"),
        "2 GiB more do not: {stdout}{stderr}"
    );
    assert!(stderr.contains("denied"), "the library says why: {stderr}");
}

#[test]
fn a_node_without_nvml_says_so() {
    let dir = std::env::temp_dir().join(format!("cudabudget-node-{}-nonvml", std::process::id()));
    let output = Command::new(env!("CARGO_BIN_EXE_cudabudget-node"))
        .args(["device-plugin", "--runtime-dir"])
        .arg(dir.join("runtime"))
        .env("LD_LIBRARY_PATH", cudabudget_fake_driver::FAKE_DRIVER_DIR)
        .env("FAKE_NVML_ABSENT", "1")
        .output()
        .expect("it runs");
    let _ = fs::remove_dir_all(&dir);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("cudabudget-node: nvmlInit_v2:"), "{stderr}");
}
