//! `cudabudget-node webhook`: AdmissionReviews of pods shaped as the API server sends them
//! (`tests/webhook/*.json`: kubectl's and a controller's pods, defaulted, with init
//! containers, sidecars, existing `env` and `LD_PRELOAD`) posted over a real TLS
//! connection to the running subcommand. The JSONPatch it answers is applied to the pod
//! it was sent, and the result must be exactly the expected pod.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

use crate::util::{self, servers};
use servers::{connect_from, idle_connections, run_briefly};

/// The node services' binary, which serves the webhook.
fn node() -> &'static Path {
    servers::node_bin()
}

fn fixture(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/webhook")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Where [`scratch`] puts `test`'s directory.
fn scratch_path(test: &str) -> PathBuf {
    std::env::temp_dir().join(format!("cudabudget-webhook-{}-{test}", std::process::id()))
}

/// A directory of this test's own, empty.
fn scratch(test: &str) -> PathBuf {
    let dir = scratch_path(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A self-signed certificate for `localhost` (cert.pem, key.pem in `dir`); its PEM.
fn self_signed(dir: &Path) -> Vec<u8> {
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    params.distinguished_name.push(
        rcgen::DnType::CommonName,
        "cudabudget-webhook.gpu-system.svc",
    );
    params.is_ca = rcgen::IsCa::ExplicitNoCa;
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let cert = params.self_signed(&key).unwrap();
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
    std::fs::write(dir.join("cert.pem"), cert.pem()).unwrap();
    cert.pem().into_bytes()
}

/// The subcommand on a free port of 127.0.0.1 with its default paths, stopped when
/// dropped; its log lines are kept.
struct Webhook {
    child: Child,
    address: String,
    ca: Vec<u8>,
    log: Arc<Mutex<Vec<String>>>,
}

impl Webhook {
    fn start(test: &str) -> Webhook {
        Webhook::start_with(test, &[])
    }

    /// The subcommand with `extra` options.
    fn start_with(test: &str, extra: &[&str]) -> Webhook {
        let dir = scratch(test);
        let ca = self_signed(&dir);
        let mut child = Command::new(node())
            .args(["webhook", "--listen", "127.0.0.1:0", "--tls-cert"])
            .arg(dir.join("cert.pem"))
            .arg("--tls-key")
            .arg(dir.join("key.pem"))
            .args(extra)
            .env_remove("LD_PRELOAD")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the webhook");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        let address = first
            .strip_prefix("cudabudget: webhook listening on https://")
            .and_then(|rest| rest.strip_suffix("/mutate"))
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
            .to_string();
        let log = Arc::new(Mutex::new(Vec::new()));
        let kept = log.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                kept.lock().unwrap().push(line);
            }
        });
        Webhook {
            child,
            address,
            ca,
            log,
        }
    }

    /// The status code of a request without a body, or `None` when the TLS handshake
    /// fails (the server's certificate is not the one trusted).
    fn try_request(&self, method: &str, path: &str) -> Option<u16> {
        let (connection, tcp) = self.connect();
        let mut stream = rustls::StreamOwned::new(connection, tcp);
        let head =
            format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
        stream.write_all(head.as_bytes()).ok()?;
        stream.flush().ok()?;
        let mut response = Vec::new();
        let _ = stream.read_to_end(&mut response);
        (!response.is_empty()).then(|| split(&response).0)
    }

    /// A TLS client trusting only the webhook's certificate, as the API server trusts its
    /// caBundle, and its connection.
    fn connect(&self) -> (rustls::ClientConnection, TcpStream) {
        self.connect_from(Ipv4Addr::LOCALHOST)
    }

    /// [`Webhook::connect`] from the client at `source`.
    fn connect_from(&self, source: Ipv4Addr) -> (rustls::ClientConnection, TcpStream) {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, ServerName};
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&self.ca) {
            roots.add(cert.unwrap()).unwrap();
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let connection = rustls::ClientConnection::new(
            Arc::new(config),
            ServerName::try_from("localhost").unwrap(),
        )
        .unwrap();
        let tcp = connect_from(source, &self.address).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        (connection, tcp)
    }

    /// (status code, head, body) of a request over TLS.
    fn request(&self, method: &str, path: &str, body: &[u8]) -> (u16, String, Vec<u8>) {
        self.request_from(Ipv4Addr::LOCALHOST, method, path, body)
    }

    /// [`Webhook::request`] from the client at `source`.
    fn request_from(
        &self,
        source: Ipv4Addr,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> (u16, String, Vec<u8>) {
        let (connection, tcp) = self.connect_from(source);
        let mut stream = rustls::StreamOwned::new(connection, tcp);
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).unwrap();
        stream.write_all(body).unwrap();
        stream.flush().unwrap();
        let mut response = Vec::new();
        // A close without close_notify is an error to rustls; what came is kept.
        let _ = stream.read_to_end(&mut response);
        split(&response)
    }

    /// The AdmissionReview answering `review`, posted to /mutate.
    fn review(&self, review: &Value) -> Value {
        let (code, head, body) =
            self.request("POST", "/mutate", &serde_json::to_vec(review).unwrap());
        assert_eq!(code, 200, "{head}\n{}", String::from_utf8_lossy(&body));
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: application/json"),
            "{head}"
        );
        let answer: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(answer["apiVersion"], "admission.k8s.io/v1", "{answer}");
        assert_eq!(answer["kind"], "AdmissionReview", "{answer}");
        assert_eq!(
            answer["response"]["uid"], review["request"]["uid"],
            "{answer}"
        );
        answer["response"].clone()
    }

    fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// Whether the webhook logs a line containing `text`: the log is read from its
    /// standard error by a thread of ours, and a line may come after the answer it is
    /// about, so this waits for it (a minute at most).
    fn logs(&self, text: &str) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !self.log().iter().any(|l| l.contains(text)) {
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }
}

impl Drop for Webhook {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// (status code, head, body) of an HTTP/1.1 response.
fn split(response: &[u8]) -> (u16, String, Vec<u8>) {
    let end = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {:?}", String::from_utf8_lossy(response)));
    let head = String::from_utf8_lossy(&response[..end]).into_owned();
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    (code, head, response[end + 4..].to_vec())
}

/// The JSONPatch of an admitted response.
fn patch_of(response: &Value) -> json_patch::Patch {
    assert_eq!(response["allowed"], true, "{response}");
    assert_eq!(response["patchType"], "JSONPatch", "{response}");
    let encoded = response["patch"]
        .as_str()
        .unwrap_or_else(|| panic!("no patch: {response}"));
    let bytes = util::base64_decode(encoded);
    serde_json::from_slice(&bytes).unwrap()
}

/// The pod `review` carries, with `patch` applied.
fn patched(review: &Value, patch: &json_patch::Patch) -> Value {
    let mut pod = review["request"]["object"].clone();
    json_patch::patch(&mut pod, patch).unwrap_or_else(|e| panic!("the patch does not apply: {e}"));
    pod
}

/// What the webhook adds to a budgeted container, with the chart's default paths.
fn budget_env(limit: &str, container: &str) -> Vec<Value> {
    vec![
        json!({"name": "CUDABUDGET_LIMIT", "value": limit}),
        json!({"name": "CUDABUDGET_SCOPE", "value": "job:llama-finetune"}),
        json!({"name": "CUDABUDGET_ON_EXCEED", "value": "wait:30s"}),
        json!({"name": "CUDABUDGET_RUNTIME_DIR", "value": "/run/cudabudget/records"}),
        json!({"name": "CUDABUDGET_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}),
        json!({"name": "CUDABUDGET_JOB_DIR", "value": "/run/cudabudget/jobs"}),
        json!({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
        json!({"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}),
        json!({"name": "CONTAINER_NAME", "value": container}),
    ]
}

fn budget_mounts() -> Vec<Value> {
    vec![
        json!({"name": "cudabudget-library", "mountPath": "/opt/cudabudget", "readOnly": true}),
        // The pod's own directory, and its namespace's for the job: never the node's.
        json!({"name": "cudabudget-runtime", "mountPath": "/run/cudabudget/records",
               "subPathExpr": "pods/$(CUDABUDGET_POD_UID)"}),
        json!({"name": "cudabudget-jobs", "mountPath": "/run/cudabudget/jobs",
               "subPath": "namespaces/ml"}),
    ]
}

/// The trainer pod as it must come out: built from the pod sent, each change spelled out.
fn expected_trainer(review: &Value) -> Value {
    let mut pod = review["request"]["object"].clone();
    let spec = &mut pod["spec"];
    let volumes = spec["volumes"].as_array_mut().unwrap();
    volumes.push(json!({"name": "cudabudget-library",
                        "hostPath": {"path": "/opt/cudabudget/current", "type": "Directory"}}));
    volumes.push(json!({"name": "cudabudget-runtime",
                        "hostPath": {"path": "/run/cudabudget/records", "type": "Directory"}}));
    volumes.push(json!({"name": "cudabudget-jobs",
                        "hostPath": {"path": "/run/cudabudget/jobs", "type": "Directory"}}));
    let ours = "/opt/cudabudget/libcudabudget.so";

    // initContainers[0] "download": no GPU, unchanged. [1] "compile-kernels": its
    // NVIDIA_VISIBLE_DEVICES=all makes it a GPU container.
    let compile = &mut spec["initContainers"][1];
    let env = compile["env"].as_array_mut().unwrap();
    env.push(json!({"name": "LD_PRELOAD", "value": ours}));
    env.extend(budget_env("20Gi", "compile-kernels"));
    compile["volumeMounts"]
        .as_array_mut()
        .unwrap()
        .extend(budget_mounts());

    // containers[0] "trainer": ours before jemalloc, in the same entry.
    let trainer = &mut spec["containers"][0];
    trainer["env"][1]["value"] =
        json!(format!("{ours}:/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"));
    trainer["env"]
        .as_array_mut()
        .unwrap()
        .extend(budget_env("20Gi", "trainer"));
    trainer["volumeMounts"]
        .as_array_mut()
        .unwrap()
        .extend(budget_mounts());

    // containers[1] "log-shipper": no GPU, its own LD_PRELOAD untouched.
    // containers[2] "server": its own annotation's budget; it had no env.
    let server = &mut spec["containers"][2];
    let mut env = vec![json!({"name": "LD_PRELOAD", "value": ours})];
    env.extend(budget_env("8Gi", "server"));
    server["env"] = Value::Array(env);
    server["volumeMounts"]
        .as_array_mut()
        .unwrap()
        .extend(budget_mounts());
    pod
}

#[test]
fn each_gpu_container_of_an_annotated_pod_gets_the_library_first_the_budget_and_the_node_directories()
 {
    let webhook = Webhook::start("trainer");
    let review = fixture("trainer.json");
    let response = webhook.review(&review);
    let patch = patch_of(&response);
    let pod = patched(&review, &patch);
    let expected = expected_trainer(&review);
    assert_eq!(
        pod,
        expected,
        "got:\n{}\nexpected:\n{}",
        serde_json::to_string_pretty(&pod).unwrap(),
        serde_json::to_string_pretty(&expected).unwrap()
    );
    // Minimal: entries are added, and the one value replaced is the trainer's LD_PRELOAD.
    let ops = serde_json::to_value(&patch).unwrap();
    for op in ops.as_array().unwrap() {
        match op["op"].as_str().unwrap() {
            "add" => {}
            "replace" => assert_eq!(op["path"], "/spec/containers/0/env/1/value", "{op}"),
            other => panic!("unexpected operation {other}: {op}"),
        }
    }
    assert!(response.get("warnings").is_none(), "{response}");
}

#[test]
fn a_pod_sent_again_after_its_patch_is_left_as_it_is() {
    // The API server calls the webhook again when a later webhook changed the pod
    // (reinvocationPolicy: IfNeeded): nothing may be added twice.
    let webhook = Webhook::start("again");
    let mut review = fixture("trainer.json");
    let patch = patch_of(&webhook.review(&review));
    review["request"]["object"] = patched(&review, &patch);
    let response = webhook.review(&review);
    assert_eq!(response["allowed"], true, "{response}");
    assert!(response.get("patch").is_none(), "{response}");
}

#[test]
fn a_pod_without_the_annotation_is_admitted_untouched() {
    let webhook = Webhook::start("untouched");
    let response = webhook.review(&fixture("untouched.json"));
    assert_eq!(response["allowed"], true, "{response}");
    assert!(response.get("patch").is_none(), "{response}");
    assert!(response.get("patchType").is_none(), "{response}");
    assert!(response.get("warnings").is_none(), "{response}");
}

#[test]
fn an_invalid_quantity_is_denied_with_a_message_naming_the_annotation() {
    let webhook = Webhook::start("invalid");
    let response = webhook.review(&fixture("invalid_limit.json"));
    assert_eq!(response["allowed"], false, "{response}");
    assert!(response.get("patch").is_none(), "{response}");
    let message = response["status"]["message"].as_str().unwrap();
    assert!(message.contains("cudabudget.io/limit"), "{message}");
    assert!(message.contains("20XB"), "{message}");
    assert!(
        message.contains("20Gi"),
        "an example of a valid value: {message}"
    );
    assert_eq!(response["status"]["code"], 422, "{response}");
    assert_eq!(response["status"]["status"], "Failure", "{response}");
    assert!(
        webhook.logs("denied pod ml/notebook-bob"),
        "{:?}",
        webhook.log()
    );
}

/// The trainer's review with `change` made to its pod.
fn trainer_with(change: impl FnOnce(&mut Value)) -> Value {
    let mut review = fixture("trainer.json");
    change(&mut review["request"]["object"]);
    review
}

#[test]
fn the_warn_policy_annotation_is_passed_to_each_budgeted_container() {
    let webhook = Webhook::start("warn");
    let review = trainer_with(|pod| {
        pod["metadata"]["annotations"]["cudabudget.io/on-exceed"] = json!("warn");
    });
    let response = webhook.review(&review);
    assert_eq!(response["allowed"], true, "{response}");
    let pod = patched(&review, &patch_of(&response));
    let policy = json!({"name": "CUDABUDGET_ON_EXCEED", "value": "warn"});
    for (index, name) in [(0, "trainer"), (2, "server")] {
        let env = pod["spec"]["containers"][index]["env"].as_array().unwrap();
        assert!(env.contains(&policy), "{name}: {env:?}");
        assert_eq!(
            env.iter()
                .filter(|e| e["name"] == "CUDABUDGET_ON_EXCEED")
                .count(),
            1,
            "{name}: {env:?}"
        );
    }
}

#[test]
fn invalid_or_unknown_annotations_and_contradicting_containers_are_denied_naming_them() {
    let webhook = Webhook::start("denials");
    let annotate = |key: &'static str, value: &'static str| {
        trainer_with(move |pod| pod["metadata"]["annotations"][key] = json!(value))
    };
    let cases = [
        (
            annotate("cudabudget.io/scope", "job:"),
            "cudabudget.io/scope",
        ),
        (
            annotate("cudabudget.io/scope", "team"),
            "cudabudget.io/scope",
        ),
        (
            annotate("cudabudget.io/on-exceed", "wait:forever"),
            "cudabudget.io/on-exceed",
        ),
        (
            annotate("cudabudget.io/on-exceed", "retry"),
            "cudabudget.io/on-exceed",
        ),
        (
            annotate("cudabudget.io/limit.server", "150%"),
            "cudabudget.io/limit.server",
        ),
        (annotate("cudabudget.io/limt", "20Gi"), "cudabudget.io/limt"),
        (
            annotate("cudabudget.io/limit.sever", "8Gi"),
            "cudabudget.io/limit.sever",
        ),
        (
            trainer_with(|pod| {
                let annotations = pod["metadata"]["annotations"].as_object_mut().unwrap();
                annotations.retain(|k, _| !k.starts_with("cudabudget.io/limit"));
            }),
            "annotations cudabudget.io/scope and cudabudget.io/on-exceed are set",
        ),
        (
            trainer_with(|pod| {
                pod["spec"]["containers"][0]["env"][0] =
                    json!({"name": "CUDABUDGET_LIMIT", "value": "40Gi"});
            }),
            "container \"trainer\": it sets CUDABUDGET_LIMIT itself",
        ),
        (
            trainer_with(|pod| {
                pod["spec"]["containers"][0]["env"][0] =
                    json!({"name": "CUDABUDGET_LIMIT_1", "value": "lots"});
            }),
            "CUDABUDGET_LIMIT_1",
        ),
        (
            trainer_with(|pod| {
                pod["spec"]["containers"][0]["env"][1] = json!({"name": "LD_PRELOAD",
                    "valueFrom": {"configMapKeyRef": {"name": "preload", "key": "LD_PRELOAD"}}});
            }),
            "LD_PRELOAD comes from valueFrom",
        ),
        (
            trainer_with(|pod| {
                pod["spec"]["containers"][2]["volumeMounts"][0]["mountPath"] =
                    json!("/opt/cudabudget");
            }),
            "container \"server\": it mounts volume \"data\" at /opt/cudabudget",
        ),
        (
            trainer_with(|pod| {
                pod["spec"]["volumes"][0]["name"] = json!("cudabudget-library");
                pod["spec"]["containers"][0]["volumeMounts"][0]["name"] =
                    json!("cudabudget-library");
            }),
            "volume \"cudabudget-library\"",
        ),
    ];
    for (review, named) in cases {
        let response = webhook.review(&review);
        let annotations = &review["request"]["object"]["metadata"]["annotations"];
        assert_eq!(response["allowed"], false, "{annotations}: {response}");
        assert!(response.get("patch").is_none(), "{response}");
        let message = response["status"]["message"].as_str().unwrap();
        assert!(message.contains(named), "{named:?} not in {message:?}");
    }
}

#[test]
fn the_same_budget_written_by_the_pod_itself_is_not_added_twice() {
    // A pod written after the chart's README (the variables and mounts by hand), then
    // annotated: nothing contradicts, nothing is duplicated.
    let webhook = Webhook::start("by-hand");
    let review = trainer_with(|pod| {
        let trainer = &mut pod["spec"]["containers"][0];
        trainer["env"].as_array_mut().unwrap().extend([
            json!({"name": "CUDABUDGET_LIMIT", "value": "20Gi"}),
            json!({"name": "CUDABUDGET_RUNTIME_DIR", "value": "/run/cudabudget/records"}),
        ]);
        trainer["volumeMounts"].as_array_mut().unwrap().push(
            json!({"name": "cudabudget-library", "mountPath": "/opt/cudabudget", "readOnly": true}),
        );
    });
    let pod = patched(&review, &patch_of(&webhook.review(&review)));
    let trainer = &pod["spec"]["containers"][0];
    for name in [
        "CUDABUDGET_LIMIT",
        "CUDABUDGET_RUNTIME_DIR",
        "CUDABUDGET_SCOPE",
        "LD_PRELOAD",
    ] {
        let count = trainer["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|v| v["name"] == name)
            .count();
        assert_eq!(count, 1, "{name} in {}", trainer["env"]);
    }
    let mounts = trainer["volumeMounts"].as_array().unwrap();
    assert_eq!(
        mounts
            .iter()
            .filter(|m| m["mountPath"] == "/opt/cudabudget")
            .count(),
        1
    );
}

#[test]
fn an_annotated_pod_without_a_gpu_container_is_admitted_untouched_with_a_warning() {
    let webhook = Webhook::start("no-gpu");
    let review = trainer_with(|pod| {
        let annotations = pod["metadata"]["annotations"].as_object_mut().unwrap();
        annotations.remove("cudabudget.io/limit.server");
        let spec = &mut pod["spec"];
        spec["initContainers"].as_array_mut().unwrap().truncate(1);
        for container in spec["containers"].as_array_mut().unwrap() {
            container["resources"] = json!({});
        }
    });
    let response = webhook.review(&review);
    assert_eq!(response["allowed"], true, "{response}");
    assert!(response.get("patch").is_none(), "{response}");
    let warnings = response["warnings"].to_string();
    assert!(
        warnings.contains("no container of this pod uses a GPU"),
        "{warnings}"
    );
}

#[test]
fn only_reviews_posted_over_tls_to_mutate_are_answered() {
    let webhook = Webhook::start("http");
    // Plain HTTP on the TLS port.
    let mut plain = TcpStream::connect(&webhook.address).unwrap();
    plain
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    plain
        .write_all(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n\r\n{}")
        .unwrap();
    let mut answer = Vec::new();
    let _ = plain.read_to_end(&mut answer);
    assert_eq!(split(&answer).0, 400);

    assert_eq!(webhook.request("GET", "/healthz", b"").0, 200);
    assert_eq!(webhook.request("GET", "/mutate", b"").0, 405);
    assert_eq!(webhook.request("POST", "/validate", b"{}").0, 404);
    let (code, _, body) = webhook.request("POST", "/mutate", b"{\"kind\": ");
    assert_eq!(code, 400, "{}", String::from_utf8_lossy(&body));
    // Still serving.
    let response = webhook.review(&fixture("untouched.json"));
    assert_eq!(response["allowed"], true);
}

#[test]
fn bad_options_are_refused_before_serving() {
    let dir = scratch("options");
    self_signed(&dir);
    let cert = dir.join("cert.pem");
    let key = dir.join("key.pem");
    let missing = dir.join("missing.pem");
    let cases: [(Vec<&std::ffi::OsStr>, &str); 3] = [
        (
            vec![
                "--tls-cert".as_ref(),
                missing.as_os_str(),
                "--tls-key".as_ref(),
                key.as_os_str(),
            ],
            "--tls-cert",
        ),
        (
            vec![
                "--tls-cert".as_ref(),
                cert.as_os_str(),
                "--tls-key".as_ref(),
                cert.as_os_str(),
            ],
            "--tls-key",
        ),
        (
            vec![
                "--tls-cert".as_ref(),
                cert.as_os_str(),
                "--tls-key".as_ref(),
                key.as_os_str(),
                "--runtime-dir".as_ref(),
                "run/cudabudget".as_ref(),
            ],
            "--runtime-dir",
        ),
    ];
    for (args, named) in cases {
        let output = Command::new(node())
            .args(["webhook", "--listen", "127.0.0.1:0"])
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(stderr.starts_with("cudabudget: "), "{stderr}");
        assert!(stderr.contains(named), "{named} not in {stderr}");
    }
}

#[test]
fn only_the_creation_of_a_pod_is_changed() {
    let webhook = Webhook::start("update");
    let mut review = fixture("trainer.json");
    review["request"]["operation"] = json!("UPDATE");
    review["request"]["oldObject"] = review["request"]["object"].clone();
    let response = webhook.review(&review);
    assert_eq!(response["allowed"], true, "{response}");
    assert!(response.get("patch").is_none(), "{response}");
}

#[test]
fn a_renewed_certificate_is_served_without_a_restart() {
    let webhook = Webhook::start("renewal");
    assert_eq!(webhook.try_request("GET", "/healthz"), Some(200));
    let dir = scratch("renewal-new");
    let renewed = self_signed(&dir);
    // Written over the files in use, as the kubelet updates a mounted Secret.
    let used = scratch_path("renewal");
    for file in ["key.pem", "cert.pem"] {
        let temporary = used.join(format!(".{file}.new"));
        std::fs::copy(dir.join(file), &temporary).unwrap();
        std::fs::rename(&temporary, used.join(file)).unwrap();
    }
    let mut webhook = webhook;
    webhook.ca = renewed;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if webhook.try_request("GET", "/healthz").is_some() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the renewed certificate is not served: {:?}",
            webhook.log()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(
        webhook.logs("serving the renewed certificate"),
        "{:?}",
        webhook.log()
    );
}

/// The denial's message for `review`, which must be denied without a patch.
fn denial(webhook: &Webhook, review: &Value) -> String {
    let response = webhook.review(review);
    assert_eq!(response["allowed"], false, "{response}");
    assert!(response.get("patch").is_none(), "{response}");
    response["status"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The trainer's review with `var` added to the trainer's env.
fn trainer_setting(var: Value) -> Value {
    trainer_with(|pod| {
        pod["spec"]["containers"][0]["env"]
            .as_array_mut()
            .unwrap()
            .push(var)
    })
}

#[test]
fn a_budgeted_container_that_would_loosen_its_budget_itself_is_denied_naming_the_variable() {
    let webhook = Webhook::start("owned");
    let without_policy = |var: Value| {
        trainer_with(|pod| {
            let annotations = pod["metadata"]["annotations"].as_object_mut().unwrap();
            annotations.remove("cudabudget.io/on-exceed");
            pod["spec"]["containers"][0]["env"]
                .as_array_mut()
                .unwrap()
                .push(var);
        })
    };
    let secret = json!({"secretKeyRef": {"name": "budgets", "key": "big"}});
    let cases = [
        // Overrides CUDABUDGET_LIMIT on device 0.
        (
            trainer_setting(json!({"name": "CUDABUDGET_LIMIT_0", "value": "1Ti"})),
            "CUDABUDGET_LIMIT_0",
        ),
        (
            without_policy(json!({"name": "CUDABUDGET_ON_EXCEED", "value": "warn"})),
            "CUDABUDGET_ON_EXCEED",
        ),
        (
            trainer_setting(json!({"name": "CUDABUDGET_LIMIT_1", "valueFrom": secret})),
            "CUDABUDGET_LIMIT_1 itself (from valueFrom)",
        ),
        (
            trainer_setting(json!({"name": "CUDABUDGET_CONTEXT_MEMORY", "value": "1"})),
            "CUDABUDGET_CONTEXT_MEMORY",
        ),
        (
            trainer_setting(json!({"name": "CUDA_DEVICE_MEMORY_LIMIT", "value": "1Ti"})),
            "CUDA_DEVICE_MEMORY_LIMIT",
        ),
        (
            trainer_setting(json!({"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "1Ti"})),
            "CUDA_DEVICE_MEMORY_LIMIT_0",
        ),
        (
            trainer_setting(
                json!({"name": "CUDA_DEVICE_MEMORY_SHARED_CACHE", "value": "/tmp/other.cache"}),
            ),
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
        ),
        (
            trainer_setting(json!({"name": "CUDABUDGET_LIB", "value": "/data/fake.so"})),
            "CUDABUDGET_LIB",
        ),
        // Elsewhere than the pod's own directory, or another pod's directory.
        (
            trainer_setting(json!({"name": "CUDABUDGET_RUNTIME_DIR", "value": "/data"})),
            "CUDABUDGET_RUNTIME_DIR itself (to \"/data\")",
        ),
        (
            trainer_setting(json!({"name": "CUDABUDGET_POD_UID", "value": "another-pod"})),
            "CUDABUDGET_POD_UID itself (to \"another-pod\")",
        ),
        (
            trainer_setting(json!({"name": "CUDABUDGET_JOB_DIR", "value": "/data"})),
            "CUDABUDGET_JOB_DIR",
        ),
        // A source whose keys the webhook cannot see.
        (
            trainer_with(|pod| {
                pod["spec"]["containers"][0]["envFrom"] =
                    json!([{"configMapRef": {"name": "trainer-settings"}}]);
            }),
            "envFrom configMapRef \"trainer-settings\" (no prefix)",
        ),
        (
            trainer_with(|pod| {
                pod["spec"]["containers"][0]["envFrom"] =
                    json!([{"prefix": "CUDA", "secretRef": {"name": "keys"}}]);
            }),
            "envFrom secretRef \"keys\" (prefix \"CUDA\")",
        ),
        (
            trainer_with(|pod| {
                pod["spec"]["containers"][0]["envFrom"] =
                    json!([{"prefix": "LD_", "configMapRef": {"name": "loader"}}]);
            }),
            "envFrom configMapRef \"loader\" (prefix \"LD_\")",
        ),
    ];
    for (review, named) in cases {
        let message = denial(&webhook, &review);
        assert!(message.contains(named), "{named:?} not in {message:?}");
        assert!(message.starts_with("container \"trainer\""), "{message}");
    }
}

#[test]
fn harmless_variables_and_prefixed_env_from_are_admitted_with_only_the_webhooks_patch() {
    let webhook = Webhook::start("harmless");
    let change = |pod: &mut Value| {
        let trainer = &mut pod["spec"]["containers"][0];
        trainer["env"].as_array_mut().unwrap().extend([
            json!({"name": "CUDABUDGET_LOG", "value": "debug"}),
            json!({"name": "CUDABUDGET_EVENTS", "value": "/data/events.jsonl"}),
            json!({"name": "CUDA_MODULE_LOADING", "value": "LAZY"}),
            json!({"name": "CUDA_VISIBLE_DEVICES", "value": "0,1"}),
        ]);
        trainer["envFrom"] = json!([
            {"prefix": "APP_", "configMapRef": {"name": "trainer-settings"}},
            {"prefix": "WANDB_", "secretRef": {"name": "wandb"}},
        ]);
        // A sidecar without a budget may take whatever it likes.
        pod["spec"]["containers"][1]["envFrom"] = json!([{"secretRef": {"name": "shipper"}}]);
        pod["spec"]["containers"][1]["env"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "CUDABUDGET_LIMIT_0", "value": "1Ti"}));
    };
    let review = trainer_with(change);
    let pod = patched(&review, &patch_of(&webhook.review(&review)));
    let mut expected = expected_trainer(&fixture("trainer.json"));
    change(&mut expected);
    // The trainer's own entries come before the webhook's.
    let env = expected["spec"]["containers"][0]["env"]
        .as_array_mut()
        .unwrap();
    let own: Vec<Value> = env.drain(env.len() - 4..).collect();
    env.splice(3..3, own);
    assert_eq!(
        pod,
        expected,
        "got:\n{}\nexpected:\n{}",
        serde_json::to_string_pretty(&pod).unwrap(),
        serde_json::to_string_pretty(&expected).unwrap()
    );
}

#[test]
fn a_container_whose_gpu_comes_from_a_dra_claim_is_budgeted_like_one_from_its_limits() {
    let webhook = Webhook::start("dra");
    let review = trainer_with(|pod| {
        let annotations = pod["metadata"]["annotations"].as_object_mut().unwrap();
        annotations.remove("cudabudget.io/limit.server");
        let spec = &mut pod["spec"];
        spec["initContainers"].as_array_mut().unwrap().truncate(1);
        spec["resourceClaims"] = json!([{"name": "gpu", "resourceClaimTemplateName": "one-h200"}]);
        spec["containers"][0]["resources"] =
            json!({"limits": {"cpu": "8"}, "claims": [{"name": "gpu"}]});
        spec["containers"][2]["resources"] = json!({"limits": {"cpu": "1"}});
    });
    let response = webhook.review(&review);
    let pod = patched(&review, &patch_of(&response));
    let containers = pod["spec"]["containers"].as_array().unwrap();
    let budget = json!({"name": "CUDABUDGET_LIMIT", "value": "20Gi"});
    assert!(
        containers[0]["env"].as_array().unwrap().contains(&budget),
        "the claim's container: {}",
        containers[0]["env"]
    );
    for other in &containers[1..] {
        let env = other["env"].as_array().map(Vec::as_slice).unwrap_or(&[]);
        assert!(
            env.iter().all(|e| e["name"] != "CUDABUDGET_LIMIT"),
            "{}: no GPU, no claim: {env:?}",
            other["name"]
        );
    }
}

#[test]
fn a_namespace_cap_denies_a_larger_budget_naming_the_cap_and_admits_one_within_it() {
    let webhook = Webhook::start_with(
        "caps",
        &["--max-limit", "ml=16Gi", "--max-limit-default", "80Gi"],
    );
    let annotated = |namespace: &'static str, key: &'static str, value: &'static str| {
        let mut review = trainer_with(|pod| {
            // Within every cap but for the annotation under test.
            pod["metadata"]["annotations"]["cudabudget.io/limit"] = json!("12Gi");
            pod["metadata"]["annotations"][key] = json!(value);
            pod["metadata"]["namespace"] = json!(namespace);
        });
        review["request"]["namespace"] = json!(namespace);
        review
    };
    // The trainer asks 20Gi in ml, capped at 16Gi.
    let message = denial(&webhook, &annotated("ml", "cudabudget.io/limit", "20Gi"));
    for named in [
        "cudabudget.io/limit",
        "20Gi",
        "namespace ml's cap of 16Gi",
        "--max-limit ml=16Gi",
    ] {
        assert!(message.contains(named), "{named:?} not in {message:?}");
    }
    let message = denial(
        &webhook,
        &annotated("ml", "cudabudget.io/limit.server", "17Gi"),
    );
    assert!(
        message.contains("cudabudget.io/limit.server: 17Gi"),
        "{message}"
    );
    let message = denial(&webhook, &annotated("ml", "cudabudget.io/limit", "50%"));
    assert!(message.contains("give a size"), "{message}");
    let message = denial(
        &webhook,
        &annotated("ml", "cudabudget.io/on-exceed", "warn"),
    );
    assert!(message.contains("cudabudget.io/on-exceed"), "{message}");
    // Another namespace falls under the default.
    let message = denial(
        &webhook,
        &annotated("research", "cudabudget.io/limit", "100Gi"),
    );
    assert!(message.contains("--max-limit-default 80Gi"), "{message}");

    // Within the caps: admitted and budgeted as asked.
    for (namespace, limit) in [("ml", "16Gi"), ("research", "80Gi")] {
        let review = annotated(namespace, "cudabudget.io/limit", limit);
        let pod = patched(&review, &patch_of(&webhook.review(&review)));
        let env = pod["spec"]["containers"][0]["env"].as_array().unwrap();
        assert!(
            env.contains(&json!({"name": "CUDABUDGET_LIMIT", "value": limit})),
            "{namespace}: {env:?}"
        );
    }
    // Without a cap, nothing is held.
    let free = Webhook::start("no-caps");
    let review = annotated("ml", "cudabudget.io/limit", "1Ti");
    assert_eq!(free.review(&review)["allowed"], true);
}

#[test]
fn a_cap_that_is_not_a_namespace_and_a_size_is_refused_before_serving() {
    let dir = scratch("cap-options");
    self_signed(&dir);
    for (options, named) in [
        (vec!["--max-limit", "ml"], "--max-limit \"ml\""),
        (vec!["--max-limit", "ml=40%"], "give a size"),
        (vec!["--max-limit", "ML_team=40Gi"], "not a namespace name"),
        (
            vec!["--max-limit", "ml=40Gi", "--max-limit", "ml=8Gi"],
            "given twice",
        ),
        (vec!["--max-limit-default", "lots"], "--max-limit-default"),
    ] {
        let output = Command::new(node())
            .args(["webhook", "--listen", "127.0.0.1:0", "--tls-cert"])
            .arg(dir.join("cert.pem"))
            .arg("--tls-key")
            .arg(dir.join("key.pem"))
            .args(&options)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{options:?}: {stderr}");
        assert!(stderr.contains(named), "{named} not in {stderr}");
    }
}

#[test]
fn a_pod_reaches_the_nodes_cudabudget_directories_only_through_the_webhooks_own_mounts() {
    let webhook = Webhook::start("mounts");
    let host_path = |path: &'static str| {
        trainer_with(move |pod| {
            pod["spec"]["volumes"]
                .as_array_mut()
                .unwrap()
                .push(json!({"name": "node", "hostPath": {"path": path}}));
        })
    };
    let cases = [
        // A sidecar without a budget mounting the volume the webhook adds.
        (
            trainer_with(|pod| {
                pod["spec"]["containers"][1]["volumeMounts"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"name": "cudabudget-runtime", "mountPath": "/all-records"}));
            }),
            "container \"log-shipper\": it mounts volume \"cudabudget-runtime\"",
        ),
        // The node's whole runtime directory where the webhook mounts the pod's own.
        (
            trainer_with(|pod| {
                pod["spec"]["containers"][0]["volumeMounts"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"name": "cudabudget-runtime",
                                 "mountPath": "/run/cudabudget/records"}));
            }),
            "container \"trainer\": it mounts volume \"cudabudget-runtime\" at \
             /run/cudabudget/records",
        ),
        (
            trainer_with(|pod| {
                pod["spec"]["containers"][0]["volumeMounts"]
                    .as_array_mut()
                    .unwrap()
                    .push(
                        json!({"name": "cudabudget-jobs", "mountPath": "/run/cudabudget/jobs",
                                 "subPath": "namespaces/research"}),
                    );
            }),
            "it mounts volume \"cudabudget-jobs\" at /run/cudabudget/jobs",
        ),
        (
            host_path("/run/cudabudget"),
            "volume \"node\" is the node's /run/cudabudget",
        ),
        (
            host_path("/run/cudabudget/records/pods/0b1c"),
            "/run/cudabudget/records/pods/0b1c",
        ),
        (host_path("/run//cudabudget/jobs/"), "job directory"),
        (host_path("/"), "volume \"node\""),
        (host_path("/opt/cudabudget"), "library directory"),
    ];
    for (review, named) in cases {
        let message = denial(&webhook, &review);
        assert!(message.contains(named), "{named:?} not in {message:?}");
    }
    // Other host paths are the cluster's policy, not the webhook's.
    let review = host_path("/var/log");
    assert_eq!(webhook.review(&review)["allowed"], true);
}

#[test]
fn review_answers_one_admission_review_on_standard_output_as_the_server_does() {
    let webhook = Webhook::start("review-file");
    let review = fixture("trainer.json");
    let served = webhook.review(&review);
    let mut child = Command::new(node())
        .args(["webhook", "--review", "-"])
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&serde_json::to_vec(&review).unwrap())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let answer: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(answer["response"], served);
    // Not a review: a usage error naming the option.
    let output = Command::new(node())
        .args(["webhook", "--review"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("--review"));
}

#[test]
fn one_client_holding_idle_connections_cannot_keep_the_api_server_or_the_probes_out() {
    const FLOODER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
    const OTHER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);
    let webhook = Webhook::start_with(
        "flood",
        &[
            "--max-connections",
            "16",
            "--max-connections-per-client",
            "4",
            "--read-timeout",
            "600",
        ],
    );
    // More idle connections than the whole cap, from one client.
    let (_held, open) = idle_connections(FLOODER, &webhook.address, 40);
    assert_eq!(open, 4, "connections of one client held open");

    let (code, _, body) = webhook.request_from(OTHER, "GET", "/healthz", b"");
    assert_eq!((code, body.as_slice()), (200, &b"ok\n"[..]));
    let review = serde_json::to_vec(&fixture("untouched.json")).unwrap();
    let (code, _, body) = webhook.request_from(OTHER, "POST", "/mutate", &review);
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
}

/// The exit status and stderr of `cudabudget args`, killed if still running after 10 s

#[test]
fn a_certificate_or_key_that_is_not_a_regular_file_refuses_the_start_naming_it() {
    let dir = scratch("not-regular");
    self_signed(&dir);
    let fifo = dir.join("fifo");
    let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let cert = dir.join("cert.pem");
    let key = dir.join("key.pem");
    let zero = Path::new("/dev/zero");
    for (cert, key, named) in [
        (
            zero,
            key.as_path(),
            "--tls-cert /dev/zero: not a regular file",
        ),
        (fifo.as_path(), key.as_path(), "--tls-cert"),
        (cert.as_path(), fifo.as_path(), "--tls-key"),
    ] {
        let (status, text) = run_briefly(Command::new(node()).args([
            "webhook".as_ref(),
            "--listen".as_ref(),
            "127.0.0.1:0".as_ref(),
            "--tls-cert".as_ref(),
            cert.as_os_str(),
            "--tls-key".as_ref(),
            key.as_os_str(),
        ]));
        assert_eq!(status, Some(2), "{text}");
        assert!(text.contains(named), "{named} not in {text}");
        assert!(text.contains("not a regular file"), "{text}");
    }
}
