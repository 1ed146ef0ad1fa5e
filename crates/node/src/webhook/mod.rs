//! `cudabudget-node webhook`: the Kubernetes mutating admission webhook. It serves
//! AdmissionReview v1 at `/mutate` over HTTPS and answers each pod with the JSONPatch of
//! [`mutate`] (its rules are there), a denial, or nothing. `/healthz` answers 200 for
//! probes.
//!
//! It runs on the node services' HTTP server ([`crate::http`]: its limits, per-client
//! connection caps, TLS and `/healthz`), which reads a request's body within the read
//! timeout and at most [`MAX_BODY`] bytes. The serving certificate is read again when
//! its files change (a renewed Secret), without a restart.

pub mod mutate;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use k8s_openapi::api::core::v1::Pod;
use kube_core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};

use crate::http::{Answer, Certificate, Peer, Site, TEXT, reply};

use crate::tell::{Refusal, say, usage};
use mutate::{Outcome, Places};

pub const AFTER_HELP: &str =
    "A pod annotated cudabudget.io/limit: 20Gi gets, in each container that uses a
GPU (resources nvidia.com/gpu, nvidia.com/gpu.*, nvidia.com/mig-*, a DRA claim
in resources.claims, or an NVIDIA_VISIBLE_DEVICES that names devices; init
containers alike):
  LD_PRELOAD=<library mount>/libcudabudget.so (first, before what was there)
  CUDABUDGET_LIMIT, CUDABUDGET_SCOPE, CUDABUDGET_ON_EXCEED (from the annotations)
  CUDABUDGET_RUNTIME_DIR=<runtime dir>, CUDABUDGET_POD_UID (downward API), and
  CUDABUDGET_JOB_DIR=<job dir> for job:
  POD_NAME, POD_NAMESPACE, CONTAINER_NAME (unless set: the exporter's labels)
  the node's library directory read-only at the library mount; the pod's own
  pods/<pod uid> of the runtime directory, and its namespace's
  namespaces/<namespace> of the job directory, at the same paths as on the node.
Annotations: cudabudget.io/limit, cudabudget.io/limit.<container> (that
container, GPU or not), cudabudget.io/scope (process, job:<name>),
cudabudget.io/on-exceed (as CUDABUDGET_ON_EXCEED). Denied, naming it: a value
the library would refuse, an unknown cudabudget.io/ annotation, a budget above
the namespace's --max-limit, a budgeted container that sets a budget variable
itself (CUDABUDGET_* but _LOG and _EVENTS, CUDA_DEVICE_MEMORY_LIMIT*,
CUDA_DEVICE_MEMORY_SHARED_CACHE, LD_PRELOAD from valueFrom) or takes envFrom
without a prefix that keeps them out, the webhook's volumes mounted otherwise,
a hostPath over the node's cudabudget directories. Pods without a
cudabudget.io/ annotation are admitted untouched.

Examples:
  cudabudget-node webhook --listen 0.0.0.0:8443 --tls-cert /etc/tls/tls.crt \\
    --tls-key /etc/tls/tls.key --max-limit ml=40Gi --max-limit-default 80Gi";

/// The largest request body read (a pod's AdmissionReview is a few KiB; the API server
/// refuses objects over 3 MiB).
pub const MAX_BODY: usize = 4 << 20;

#[derive(Args)]
pub struct WebhookArgs {
    /// Address and port to serve HTTPS on (port 0: any free port, printed at start).
    #[arg(long, value_name = "ADDR:PORT", required_unless_present = "review")]
    listen: Option<String>,

    /// The serving certificate (PEM, the chain after it), e.g. a kubernetes.io/tls
    /// Secret's tls.crt.
    #[arg(
        long = "tls-cert",
        value_name = "FILE",
        required_unless_present = "review"
    )]
    tls_cert: Option<PathBuf>,

    /// The certificate's private key (PEM).
    #[arg(
        long = "tls-key",
        value_name = "FILE",
        required_unless_present = "review"
    )]
    tls_key: Option<PathBuf>,

    /// Serve nothing: answer the AdmissionReview in FILE ('-': standard input) on
    /// standard output, as /mutate would, and exit (what the webhook does to a pod).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["listen", "tls_cert", "tls_key"])]
    review: Option<PathBuf>,

    /// The node's library directory (the installer's <libraryDir>/current), mounted
    /// read-only into budgeted containers.
    #[arg(
        long = "library-dir",
        value_name = "DIR",
        default_value = "/opt/cudabudget/current"
    )]
    library_dir: String,

    /// Where containers see the library directory; LD_PRELOAD names
    /// libcudabudget.so there.
    #[arg(
        long = "library-mount",
        value_name = "DIR",
        default_value = "/opt/cudabudget"
    )]
    library_mount: String,

    /// The node-wide runtime directory (CUDABUDGET_RUNTIME_DIR) the exporter reads,
    /// mounted at the same path.
    #[arg(
        long = "runtime-dir",
        value_name = "DIR",
        default_value = "/run/cudabudget/records"
    )]
    runtime_dir: String,

    /// The node-wide job directory (CUDABUDGET_JOB_DIR) for cudabudget.io/scope: job:...,
    /// mounted at the same path.
    #[arg(
        long = "job-dir",
        value_name = "DIR",
        default_value = "/run/cudabudget/jobs"
    )]
    job_dir: String,

    /// The largest budget the pods of NAMESPACE may ask for (a size such as 40Gi);
    /// repeat for each namespace. A pod asking for more, or for a percentage or `warn`,
    /// is denied.
    #[arg(long = "max-limit", value_name = "NAMESPACE=SIZE")]
    max_limit: Vec<String>,

    /// The largest budget the pods of any namespace not named by --max-limit may ask for.
    #[arg(long = "max-limit-default", value_name = "SIZE")]
    max_limit_default: Option<String>,

    /// Seconds a client has to send a request (head and body); also how long an idle
    /// keep-alive connection is kept.
    #[arg(long = "read-timeout", value_name = "SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    read_timeout: u64,

    /// Connections served at once; beyond, a new one is closed at once (a few more are
    /// kept for clients that hold none).
    #[arg(long = "max-connections", value_name = "N", default_value_t = 1024,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_connections: u64,

    /// Connections served at once from one client (an IPv4 address, an IPv6 /64);
    /// beyond, its new one is closed at once.
    #[arg(long = "max-connections-per-client", value_name = "N", default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_connections_per_client: u64,
}

/// An absolute directory without a trailing '/', or a usage error naming the option.
fn directory(option: &str, value: &str) -> Result<String, Refusal> {
    let trimmed = value.trim_end_matches('/');
    let plain = trimmed.starts_with('/')
        && !trimmed
            .split('/')
            .skip(1)
            .any(|part| part.is_empty() || part == "." || part == "..");
    if !plain {
        return Err(usage(format!(
            "{option} {value:?}: use an absolute directory of plain names, e.g. /opt/cudabudget"
        )));
    }
    Ok(trimmed.to_string())
}

/// A cap's size in bytes, or a usage error naming the option.
fn cap_size(option: &str, text: &str) -> Result<(u64, String), Refusal> {
    match cudabudget_spec::quantity::parse_limit(text) {
        Ok(cudabudget_spec::quantity::Limit::Bytes(bytes)) => Ok((bytes, text.trim().to_string())),
        Ok(cudabudget_spec::quantity::Limit::Percent(_)) => Err(usage(format!(
            "{option} {text:?}: give a size (e.g. 40Gi); a share of a device is not a cap"
        ))),
        Err(error) => Err(usage(format!("{option} {text:?} is not a size: {error}"))),
    }
}

/// The caps of `--max-limit NAMESPACE=SIZE` and `--max-limit-default SIZE`.
fn caps(per_namespace: &[String], default: Option<&str>) -> Result<mutate::Caps, Refusal> {
    let mut caps = mutate::Caps::default();
    for given in per_namespace {
        let Some((namespace, size)) = given.split_once('=') else {
            return Err(usage(format!(
                "--max-limit {given:?}: give NAMESPACE=SIZE, e.g. ml=40Gi"
            )));
        };
        let namespace = namespace.trim();
        let label = !namespace.is_empty()
            && namespace.len() <= 63
            && namespace
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !namespace.starts_with('-')
            && !namespace.ends_with('-');
        if !label {
            return Err(usage(format!(
                "--max-limit {given:?}: {namespace:?} is not a namespace name"
            )));
        }
        let size = cap_size("--max-limit", size)?;
        if caps
            .per_namespace
            .insert(namespace.to_string(), size)
            .is_some()
        {
            return Err(usage(format!(
                "--max-limit: namespace {namespace} is given twice"
            )));
        }
    }
    if let Some(text) = default {
        caps.default = Some(cap_size("--max-limit-default", text)?);
    }
    Ok(caps)
}

pub fn webhook(args: WebhookArgs) -> Result<ExitCode, Refusal> {
    let places = Places {
        library_dir: directory("--library-dir", &args.library_dir)?,
        library_mount: directory("--library-mount", &args.library_mount)?,
        runtime_dir: directory("--runtime-dir", &args.runtime_dir)?,
        job_dir: directory("--job-dir", &args.job_dir)?,
        caps: caps(&args.max_limit, args.max_limit_default.as_deref())?,
    };
    if let Some(file) = &args.review {
        return review_file(file, &places);
    }
    let (Some(listen), Some(cert), Some(key)) = (args.listen, args.tls_cert, args.tls_key) else {
        return Err(usage(
            "give --listen, --tls-cert and --tls-key (or --review FILE)",
        ));
    };
    let certificate = Certificate::load(cert, key).map_err(usage)?;
    let listener = std::net::TcpListener::bind(listen.as_str()).map_err(|e| {
        usage(format!(
            "--listen {listen:?}: cannot listen there ({e}); give ADDR:PORT, e.g. 0.0.0.0:8443"
        ))
    })?;
    let address = listener
        .local_addr()
        .map_or_else(|_| listen.clone(), |a| a.to_string());
    say(format!("webhook listening on https://{address}/mutate"));
    let server = crate::http::Server {
        name: "webhook",
        listener,
        tls: crate::http::Tls::Renewable(certificate),
        limits: crate::http::Limits {
            max_connections: usize::try_from(args.max_connections).unwrap_or(usize::MAX),
            per_client: usize::try_from(args.max_connections_per_client).unwrap_or(usize::MAX),
            read_timeout: Duration::from_secs(args.read_timeout),
            max_body: MAX_BODY,
        },
        users: Default::default(),
        headers: Vec::new(),
    };
    crate::http::serve(server, Admission { places })
        .map_err(|message| Refusal { message, status: 1 })?;
    Ok(ExitCode::SUCCESS)
}

/// `--review FILE`: the answer to the AdmissionReview in `file` on standard output.
fn review_file(file: &Path, places: &Places) -> Result<ExitCode, Refusal> {
    use std::io::{Read, Write};
    let mut body = Vec::new();
    let read = if file == Path::new("-") {
        std::io::stdin()
            .take(MAX_BODY as u64 + 1)
            .read_to_end(&mut body)
    } else {
        std::fs::File::open(file).and_then(|f| f.take(MAX_BODY as u64 + 1).read_to_end(&mut body))
    };
    read.map_err(|e| usage(format!("--review {}: cannot read it ({e})", file.display())))?;
    if body.len() > MAX_BODY {
        return Err(usage(format!(
            "--review {}: larger than {MAX_BODY} bytes",
            file.display()
        )));
    }
    let answer = review(&body, places).map_err(|why| {
        usage(format!(
            "--review {}: not an AdmissionReview v1 of a pod: {why}",
            file.display()
        ))
    })?;
    let mut out = std::io::stdout().lock();
    out.write_all(&answer)
        .and_then(|()| out.write_all(b"\n"))
        .map_err(|e| Refusal {
            message: format!("cannot write the answer ({e})"),
            status: 1,
        })?;
    Ok(ExitCode::SUCCESS)
}

/// What the webhook answers: reviews posted to /mutate.
struct Admission {
    places: Places,
}

impl Site for Admission {
    async fn answer(&self, request: Request<Bytes>, _peer: Peer) -> Answer {
        match (request.method(), request.uri().path()) {
            (&Method::POST, "/mutate") => match review(request.body(), &self.places) {
                Ok(review) => reply(StatusCode::OK, "application/json", review),
                Err(why) => reply(
                    StatusCode::BAD_REQUEST,
                    TEXT,
                    format!("not an AdmissionReview v1 of a pod: {why}\n"),
                ),
            },
            (_, "/mutate") => reply(
                StatusCode::METHOD_NOT_ALLOWED,
                TEXT,
                "POST an AdmissionReview to /mutate\n",
            ),
            _ => reply(
                StatusCode::NOT_FOUND,
                TEXT,
                "not found; AdmissionReviews go to /mutate\n",
            ),
        }
    }
}

/// `namespace/name` of the pod under review (its generateName prefix before it has a name).
fn pod_name(request: &AdmissionRequest<Pod>) -> String {
    let pod = request.object.as_ref().and_then(|p| {
        p.metadata
            .name
            .clone()
            .or_else(|| p.metadata.generate_name.clone())
    });
    format!(
        "{}/{}",
        request.namespace.as_deref().unwrap_or_default(),
        pod.unwrap_or_default()
    )
}

/// The AdmissionReview answering `body`, serialized.
pub fn review(body: &[u8], places: &Places) -> Result<Vec<u8>, String> {
    let review: AdmissionReview<Pod> = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let request: AdmissionRequest<Pod> = review
        .try_into()
        .map_err(|_| "it carries no request".to_string())?;
    let response = AdmissionResponse::from(&request);
    let is_pod = request.kind.group.is_empty() && request.kind.kind == "Pod";
    let outcome = match (&request.object, &request.operation) {
        (Some(pod), Operation::Create) if is_pod => {
            let namespace = request
                .namespace
                .as_deref()
                .or(pod.metadata.namespace.as_deref())
                .unwrap_or_default();
            mutate::mutate(pod, namespace, places)
        }
        _ => Outcome::Untouched(Vec::new()),
    };
    let response = match outcome {
        Outcome::Untouched(warnings) => {
            let mut response = response;
            if !warnings.is_empty() {
                response.warnings = Some(warnings);
            }
            response
        }
        Outcome::Denied(message) => {
            let mut response = response.deny(&message);
            response.result.status = Some(kube_core::response::StatusSummary::Failure);
            response.result.code = 422;
            response.result.reason = "Invalid".to_string();
            say(format!(
                "webhook: denied pod {}: {message}",
                pod_name(&request)
            ));
            response
        }
        Outcome::Patched(ops) => {
            say(format!(
                "webhook: budgeted pod {} ({} changes)",
                pod_name(&request),
                ops.len()
            ));
            let patch: json_patch::Patch = serde_json::from_value(serde_json::Value::Array(ops))
                .map_err(|e| format!("the patch made is not a JSONPatch ({e}): a bug"))?;
            response
                .with_patch(patch)
                .map_err(|e| format!("cannot write the patch ({e})"))?
        }
    };
    // The API's JSON has the patch in base64 (Go's []byte); kube-core writes it as an
    // array of numbers, which the API server happens to read too: written as documented.
    let mut response = response;
    let patch = response.patch.take();
    let mut review = serde_json::to_value(response.into_review()).map_err(|e| e.to_string())?;
    if let Some(patch) = patch {
        review["response"]["patch"] =
            serde_json::to_value(k8s_openapi::ByteString(patch)).map_err(|e| e.to_string())?;
    }
    serde_json::to_vec(&review).map_err(|e| e.to_string())
}
