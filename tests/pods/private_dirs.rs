//! What a pod can open is only its own: its runtime directory (`pods/<pod uid>` of the
//! node's) and its namespace's job directory (`namespaces/<namespace>`). Pod B, root in
//! its own namespaces like pod A, cannot ask A's process to change its budget nor change
//! A's job; two namespaces naming `job:train` get two ledgers; root on the node sees
//! both pods and reaches both jobs.

use std::io::{BufRead, BufReader, Lines};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::util;
use crate::util::cli::{BIN, output, stderr, stdout};

/// A GPU node as the chart lays it out: the runtime and job directories root's and
/// 1777 with `pods/` and `namespaces/` (0755) in them, the library in a directory of
/// root's.
struct Node {
    dir: PathBuf,
    runtime: PathBuf,
    jobs: PathBuf,
    library: PathBuf,
}

impl Node {
    /// The node, or `None` (the test is skipped, with a line) without root or PID
    /// namespaces.
    fn new() -> Option<Node> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            util::skip("pods are modelled with mount and PID namespaces, which need root");
            return None;
        }
        let probe = Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc", "true"])
            .output();
        if !probe.is_ok_and(|out| out.status.success()) {
            util::skip("this machine cannot create a PID namespace (unshare --pid)");
            return None;
        }
        let dir = util::test_dir().join("node");
        let _ = std::fs::remove_dir_all(&dir);
        let (runtime, jobs, library) = (dir.join("records"), dir.join("jobs"), dir.join("lib"));
        for (place, mode) in [
            (&runtime, 0o1777),
            (&jobs, 0o1777),
            (&runtime.join("pods"), 0o755),
            (&jobs.join("namespaces"), 0o755),
            (&library, 0o755),
        ] {
            std::fs::create_dir_all(place).unwrap();
            std::fs::set_permissions(place, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        std::fs::copy(util::cli::fresh_library(), library.join("libcudabudget.so")).unwrap();
        Some(Node {
            dir,
            runtime,
            jobs,
            library,
        })
    }

    /// The pod `name` of `namespace`, annotated so, as the webhook patches it (one
    /// container, `main`, with a GPU), with the UID the API server gave it.
    fn pod(&self, namespace: &str, name: &str, annotations: Value) -> Pod {
        let object = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
            "spec": {"containers": [{"name": "main", "image": "pytorch",
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
        });
        let review = json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "8d4c2a1e-0000-4000-8000-000000000001",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": namespace,
                "operation": "CREATE",
                "userInfo": {"username": "tenant"},
                "object": object
            }
        });
        let file = self.dir.join(format!("review-{name}.json"));
        std::fs::write(&file, serde_json::to_vec(&review).unwrap()).unwrap();
        let library = self.library.to_str().unwrap();
        let out = output(Command::new(crate::util::servers::node_bin()).args([
            "webhook",
            "--review",
            file.to_str().unwrap(),
            "--runtime-dir",
            self.runtime.to_str().unwrap(),
            "--job-dir",
            self.jobs.to_str().unwrap(),
            "--library-dir",
            library,
            "--library-mount",
            library,
        ]));
        assert!(out.status.success(), "{}", stderr(&out));
        let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
        let response = &answer["response"];
        assert_eq!(response["allowed"], true, "{response}");
        let patch: k8s_openapi::ByteString =
            serde_json::from_value(response["patch"].clone()).unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&patch.0).unwrap();
        let mut pod = object;
        json_patch::patch(&mut pod, &patch).unwrap();
        Pod::as_the_kubelet_makes(&pod, &format!("{namespace}-{name}-uid"))
    }
}

/// A pod's container as the kubelet starts it.
struct Pod {
    name: String,
    /// Its environment, the downward API's values filled in.
    env: Vec<(String, String)>,
    /// (the node's directory, where the container sees it).
    mounts: Vec<(PathBuf, PathBuf)>,
}

impl Pod {
    fn as_the_kubelet_makes(pod: &Value, uid: &str) -> Pod {
        let metadata = &pod["metadata"];
        let container = &pod["spec"]["containers"][0];
        let env: Vec<(String, String)> = container["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|var| {
                let value = match var["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                    Some("metadata.uid") => uid,
                    Some("metadata.name") => metadata["name"].as_str().unwrap(),
                    Some("metadata.namespace") => metadata["namespace"].as_str().unwrap(),
                    Some(other) => panic!("no downward API field {other} here"),
                    None => var["value"].as_str().unwrap(),
                };
                (var["name"].as_str().unwrap().to_string(), value.to_string())
            })
            .collect();
        let mut mounts = Vec::new();
        for mount in container["volumeMounts"].as_array().unwrap() {
            let volume = pod["spec"]["volumes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|v| v["name"] == mount["name"])
                .unwrap();
            let root = PathBuf::from(volume["hostPath"]["path"].as_str().unwrap());
            let mut sub = mount["subPath"].as_str().unwrap_or_default().to_string();
            if let Some(expression) = mount["subPathExpr"].as_str() {
                sub = expression.to_string();
                for (name, value) in &env {
                    sub = sub.replace(&format!("$({name})"), value);
                }
            }
            // The kubelet makes a missing sub-path with the volume's own mode.
            let mode = std::fs::metadata(&root).unwrap().permissions().mode() & 0o7777;
            let mut source = root;
            for part in Path::new(&sub).components() {
                source.push(part);
                if !source.exists() {
                    std::fs::DirBuilder::new()
                        .mode(mode)
                        .create(&source)
                        .unwrap();
                    std::fs::set_permissions(&source, std::fs::Permissions::from_mode(mode))
                        .unwrap();
                }
            }
            let target = PathBuf::from(mount["mountPath"].as_str().unwrap());
            mounts.push((source, target));
        }
        Pod {
            name: metadata["name"].as_str().unwrap().to_string(),
            env,
            mounts,
        }
    }

    /// `program args…` in a new container of the pod: as root, in mount and PID
    /// namespaces of its own with the pod's mounts, with the pod's environment (and the
    /// fake driver).
    fn command(&self, program: &Path, args: &[&str]) -> Command {
        let mut script = String::from("set -e\n");
        for (source, target) in &self.mounts {
            script.push_str(&format!(
                "mount --bind '{}' '{}'\n",
                source.display(),
                target.display()
            ));
        }
        script.push_str("exec \"$@\"\n");
        let mut command = Command::new("unshare");
        command
            .args([
                "--pid",
                "--fork",
                "--kill-child",
                "--mount-proc",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                &script,
                "sh",
            ])
            .arg(program)
            .args(args)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("LD_LIBRARY_PATH", util::fake_dir())
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null());
        command
    }

    /// A budgeted client running `ops` in the pod, its output lines read as they come.
    fn start(&self, ops: &[&str]) -> Running {
        let mut child = self
            .command(
                Path::new(util::client_bin("gpa")),
                &[&["gpa"], ops].concat(),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the pod's process starts");
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Running { child, lines }
    }

    /// A budgeted client in the pod that allocates 64 MiB, then 64 MiB more once the
    /// file it returns exists; started when its first allocation is done.
    fn start_allocating_again_at_go(&self, node: &Node) -> (Running, PathBuf) {
        let go = node.dir.join(format!("go-{}", self.name));
        let mut running = self.start(&[
            "alloc:64Mi",
            &format!("waitfile:{}", go.display()),
            "alloc:64Mi",
            "sleep:60000",
        ]);
        assert!(running.line("alloc").contains("rc=0"));
        (running, go)
    }

    /// The CLI run in the pod (a container of its own, as `kubectl exec` would).
    fn cli(&self, args: &[&str]) -> std::process::Output {
        output(&mut self.command(Path::new(BIN), args))
    }

    /// A shell script run in the pod.
    fn shell(&self, script: &str) -> std::process::Output {
        output(&mut self.command(Path::new("/bin/sh"), &["-c", script]))
    }
}

/// A pod's process, killed (with its PID namespace) when dropped.
struct Running {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Running {
    /// The pod's process (unshare's child) as the node sees it: its pid there, and the
    /// inode of its own PID namespace.
    fn on_the_node(&self) -> (u32, u64) {
        let pid = self.child.id();
        let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .expect("unshare's children");
        let outer: u32 = children
            .split_whitespace()
            .next()
            .expect("the pod's process")
            .parse()
            .unwrap();
        let link = std::fs::read_link(format!("/proc/{outer}/ns/pid")).unwrap();
        let link = link.to_string_lossy();
        let namespace = link
            .trim_start_matches("pid:[")
            .trim_end_matches(']')
            .parse()
            .unwrap_or_else(|_| panic!("{link}"));
        (outer, namespace)
    }

    /// The next line of output starting with `op` (the client writes one line per op).
    fn line(&mut self, op: &str) -> String {
        for line in self.lines.by_ref() {
            let line = line.unwrap();
            if line.starts_with(op) {
                return line;
            }
        }
        panic!("the pod's process ended before its {op}");
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `cudabudget` as root on the node, with the node's directories.
fn on_the_node(node: &Node, args: &[&str]) -> std::process::Output {
    output(
        util::cli::cli_at(Path::new(BIN), args)
            .env("CUDABUDGET_RUNTIME_DIR", &node.runtime)
            .env("CUDABUDGET_JOB_DIR", &node.jobs),
    )
}

/// The processes root's `status --json` on the node shows.
fn node_status(node: &Node) -> Vec<Value> {
    let out = on_the_node(node, &["status", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let status: Value = serde_json::from_slice(&out.stdout).unwrap();
    status["processes"].as_array().cloned().unwrap_or_default()
}

/// Waits (up to 20 s) until root's status on the node shows a process of each of `pods`
/// for which `holds` is true; those processes, in the order of `pods`.
fn shown_on_the_node(node: &Node, pods: &[&Pod], holds: impl Fn(&Value) -> bool) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let processes = node_status(node);
        let found: Vec<Value> = pods
            .iter()
            .filter_map(|pod| {
                processes
                    .iter()
                    .find(|p| p["pod"] == pod.name.as_str() && holds(p))
                    .cloned()
            })
            .collect();
        if found.len() == pods.len() {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "root on the node never saw every pod's process: {processes:#?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_pod_cannot_change_another_pods_budget_and_root_on_the_node_sees_both_pods() {
    let Some(node) = Node::new() else { return };
    let budget = json!({"cudabudget.io/limit": "1Gi"});
    let a = node.pod("team-a", "trainer", budget.clone());
    let b = node.pod("team-b", "intruder", budget);
    let (mut trainer, go) = a.start_allocating_again_at_go(&node);
    let mut intruder = b.start(&["alloc:32Mi", "sleep:60000"]);
    assert!(intruder.line("alloc").contains("rc=0"));
    let shown = shown_on_the_node(&node, &[&a, &b], |_| true);
    assert_eq!(shown[0]["namespace"], "team-a", "{shown:?}");
    assert_eq!(shown[1]["namespace"], "team-b", "{shown:?}");
    let pid = &shown[0]["pid"];

    // Pod B sees only itself.
    let out = b.cli(&["status", "--json"]);
    let seen: Value = serde_json::from_slice(&out.stdout).unwrap();
    let pods: Vec<&Value> = seen["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| &p["pod"])
        .collect();
    assert_eq!(pods, [&json!("intruder")], "pod B's status: {seen:#}");

    // Pod B, root too, writes a request for A's process (budget 0 B) where A's library
    // looks for one if the runtime directory were shared.
    let request = cudabudget_spec::control::LimitRequest {
        device: None,
        bytes: 0,
        by_uid: 0,
        by_pid: 1,
    };
    // The request A's library reads is named by A's pid and PID namespace.
    let name = cudabudget_spec::control::file_name(
        u32::try_from(pid.as_u64().unwrap()).unwrap(),
        trainer.on_the_node().1,
    );
    let runtime = node.runtime.display();
    let out = b.shell(&format!(
        "umask 077; mkdir -p {runtime}/cudabudget-0 && printf '%s' '{}' > {runtime}/cudabudget-0/{name}",
        request.encode()
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    // A's library looks for a request every 200 ms and rewrites its record at least
    // every 5 s: two rewrites after the request was written, it has looked.
    let mut last = shown_on_the_node(&node, &[&a], |_| true)[0]["updated_ms"].clone();
    for _ in 0..2 {
        let before = last.as_u64().unwrap();
        last = shown_on_the_node(&node, &[&a], |p| {
            p["updated_ms"].as_u64().is_some_and(|t| t > before)
        })[0]["updated_ms"]
            .clone();
    }
    let now = shown_on_the_node(&node, &[&a], |_| true);
    assert_eq!(
        now[0]["devices"][0]["limit_bytes"],
        1u64 << 30,
        "pod B changed pod A's budget: {now:#?}"
    );
    std::fs::write(&go, b"").unwrap();
    assert!(trainer.line("waitfile").contains("rc=0"));
    let allocation = trainer.line("alloc");
    assert!(
        allocation.contains("rc=0"),
        "A's next allocation: {allocation}"
    );

    // Root on the node names A's process by its pid there (another than in the pod).
    let outer = trainer.on_the_node().0.to_string();
    let out = on_the_node(&node, &["limit", "--pid", &outer, "2Gi"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(
        stdout(&out).contains("budget 2.00 GiB"),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let now = shown_on_the_node(&node, &[&a], |p| {
        p["devices"][0]["limit_bytes"] == 2u64 << 30
    });
    assert_eq!(now[0]["namespace"], "team-a", "{now:#?}");
}

#[test]
fn a_job_name_in_two_namespaces_is_two_ledgers_and_a_pod_reaches_only_its_namespaces() {
    let Some(node) = Node::new() else { return };
    let job =
        |limit: &str| json!({"cudabudget.io/limit": limit, "cudabudget.io/scope": "job:train"});
    let a = node.pod("team-a", "trainer", job("1Gi"));
    let b = node.pod("team-b", "other-trainer", job("1Gi"));
    let (mut trainer, go) = a.start_allocating_again_at_go(&node);
    let mut other = b.start(&["alloc:32Mi", "sleep:60000"]);
    assert!(other.line("alloc").contains("rc=0"));
    let shown = shown_on_the_node(&node, &[&a, &b], |p| p["job"] == "train");
    assert_eq!(shown.len(), 2);
    for namespace in ["team-a", "team-b"] {
        let ledger = node
            .jobs
            .join(format!("namespaces/{namespace}/cudabudget-0/job-train"));
        assert!(ledger.is_file(), "{}: no ledger", ledger.display());
    }

    // Pod B's `limit --job train` is its own namespace's job (one byte: were it A's, A's
    // next allocation would be refused).
    let out = b.cli(&["limit", "--job", "train", "1"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    std::fs::write(&go, b"").unwrap();
    assert!(trainer.line("waitfile").contains("rc=0"));
    let allocation = trainer.line("alloc");
    assert!(
        allocation.contains("rc=0"),
        "pod B changed pod A's job: A's next allocation {allocation}"
    );

    // Root on the node reaches both, one at a time.
    let out = on_the_node(&node, &["limit", "--job", "train"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    for named in ["team-a", "team-b", "--namespace"] {
        assert!(stderr(&out).contains(named), "{named}: {}", stderr(&out));
    }
    let out = on_the_node(&node, &["limit", "--job", "train", "--namespace", "team-a"]);
    assert!(
        stdout(&out).contains("job train device 0: budget 1.00 GiB"),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let out = on_the_node(
        &node,
        &["limit", "--job", "train", "--namespace", "team-b", "2Gi"],
    );
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let out = b.cli(&["limit", "--job", "train"]);
    assert!(
        stdout(&out).contains("budget 2.00 GiB"),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
}
