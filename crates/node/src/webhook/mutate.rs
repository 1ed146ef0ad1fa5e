//! What the webhook does to a pod: its `cudabudget.io/` annotations read and checked, and
//! the JSONPatch that budgets each container that uses a GPU. Pure: a pod in, a patch or
//! a denial out.
//!
//! A container uses a GPU when its resources ask for a non-zero `nvidia.com/gpu` (or a
//! renamed share of it, `nvidia.com/gpu.*`, or a MIG slice, `nvidia.com/mig-*`), when it
//! names a DRA claim (`resources.claims`: the webhook cannot see the claim's device
//! class, so any claim counts), when its `NVIDIA_VISIBLE_DEVICES` names devices (not
//! empty, `void` or `none`), or when a `cudabudget.io/limit.<container>` annotation names
//! it. Init containers follow the same rules: one that uses a GPU is budgeted like the
//! others.
//!
//! The pod is the tenant. Its budgeted containers see the node's runtime directory only
//! at `pods/<pod uid>` (a `subPathExpr` on the downward API's `metadata.uid`), and a job's
//! ledgers only at `namespaces/<namespace>` of the node's job directory: one pod cannot
//! reach another's records or requests, nor a job of another namespace.
//!
//! The webhook is the policy point: it owns the budget variables of a budgeted container.
//! A container that sets one itself (`CUDABUDGET_*` but `CUDABUDGET_LOG` and
//! `CUDABUDGET_EVENTS`, `CUDA_DEVICE_MEMORY_LIMIT*`, `CUDA_DEVICE_MEMORY_SHARED_CACHE`,
//! by value or `valueFrom`) is denied, naming it, unless it is exactly what the webhook
//! sets; `LD_PRELOAD` is overwritten (ours first); an `envFrom` source that could carry
//! such a name (no `prefix`, or one that could begin one) is denied; so are the webhook's
//! volumes mounted any other way, in any container, and a hostPath volume over the node's
//! cudabudget directories. An operator's cap for the namespace (`--max-limit`) bounds the
//! annotations' budgets.
//!
//! It never admits a pod unbudgeted that asked for a budget: an annotation that the
//! library would refuse, an unknown `cudabudget.io/` annotation (a typo), a per-container
//! annotation naming no container, or a container whose own settings contradict what the
//! webhook would add is a denial whose message names the annotation or the container.
//! It changes nothing else: entries are added after the existing ones, the only value
//! replaced is an existing `LD_PRELOAD`'s (ours first, never twice), and a pod that was
//! patched already gets an empty patch (the API server may call a webhook twice).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, EnvVar, Pod, Volume, VolumeMount};
use serde_json::{Value, json};

use crate::records::{NAMESPACES, PODS};
use cudabudget_spec::config;
use cudabudget_spec::quantity::{self, Limit};

/// Every annotation the webhook reads starts so.
pub const PREFIX: &str = "cudabudget.io/";
/// The budget of every GPU container of the pod (`CUDABUDGET_LIMIT`).
pub const LIMIT: &str = "cudabudget.io/limit";
/// `process` or `job:<name>` (`CUDABUDGET_SCOPE`).
pub const SCOPE: &str = "cudabudget.io/scope";
/// `fail`, `wait:<duration>`, ... (`CUDABUDGET_ON_EXCEED`).
pub const ON_EXCEED: &str = "cudabudget.io/on-exceed";
/// `cudabudget.io/limit.<container>`: that container's budget, GPU or not.
pub const LIMIT_OF: &str = "cudabudget.io/limit.";

const LIBRARY_VOLUME: &str = "cudabudget-library";
const RUNTIME_VOLUME: &str = "cudabudget-runtime";
const JOB_VOLUME: &str = "cudabudget-jobs";

/// The variable the downward API fills with the pod's UID: the runtime mount's
/// `subPathExpr` names the pod's own directory with it.
const POD_UID: &str = config::POD_UID;

/// `CUDABUDGET_*` variables a budgeted container may set itself: they change what is
/// said, not what is allowed.
const HARMLESS: [&str; 2] = [config::LOG, config::EVENTS];
/// Prefixes of the variables the webhook owns in a budgeted container.
const OWNED_PREFIXES: [&str; 2] = ["CUDABUDGET_", config::HAMI_LIMIT];
/// Whole names it owns besides.
const OWNED_NAMES: [&str; 2] = [config::HAMI_SHARED_CACHE, "LD_PRELOAD"];

/// Where things are on the node and in the container, and what the operator allows.
#[derive(Clone, Debug)]
pub struct Places {
    /// The node's library directory (`<libraryDir>/current`), a hostPath.
    pub library_dir: String,
    /// Where containers see it (read-only); `LD_PRELOAD` names `libcudabudget.so` there.
    pub library_mount: String,
    /// The node's runtime directory (`CUDABUDGET_RUNTIME_DIR`): a container sees its
    /// pod's `pods/<pod uid>` of it at the same path.
    pub runtime_dir: String,
    /// The node's job directory (`CUDABUDGET_JOB_DIR`), mounted for `job:` scopes: a
    /// container sees its namespace's `namespaces/<namespace>` of it at the same path.
    pub job_dir: String,
    /// The largest budgets namespaces may ask for.
    pub caps: Caps,
}

/// The operator's caps on what a namespace's annotations may ask (`--max-limit`,
/// `--max-limit-default`; the chart's `webhook.maxLimit`).
#[derive(Clone, Debug, Default)]
pub struct Caps {
    /// Namespace -> (bytes, as written).
    pub per_namespace: BTreeMap<String, (u64, String)>,
    /// For the namespaces not named: (bytes, as written).
    pub default: Option<(u64, String)>,
}

impl Caps {
    /// The cap of `namespace` in bytes, and where it comes from in words.
    fn of(&self, namespace: &str) -> Option<(u64, String)> {
        match self.per_namespace.get(namespace) {
            Some((bytes, text)) => Some((
                *bytes,
                format!(
                    "namespace {namespace}'s cap of {text} (webhook --max-limit \
                     {namespace}={text}, the chart's webhook.maxLimit)"
                ),
            )),
            None => self.default.as_ref().map(|(bytes, text)| {
                (
                    *bytes,
                    format!(
                        "the cap of {text} for namespace {namespace} (webhook \
                         --max-limit-default {text}, the chart's webhook.maxLimit[\"*\"])"
                    ),
                )
            }),
        }
    }
}

impl Places {
    fn library(&self) -> String {
        format!(
            "{}/libcudabudget.so",
            self.library_mount.trim_end_matches('/')
        )
    }
}

/// What the webhook answers.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// Admitted as it is (with warnings for the client, if any).
    Untouched(Vec<String>),
    /// Admitted with these JSONPatch operations.
    Patched(Vec<Value>),
    /// Refused; the message names the annotation or container at fault.
    Denied(String),
}

/// The budget the annotations ask for, checked.
struct Budget {
    limit: Option<String>,
    per_container: BTreeMap<String, String>,
    scope: Option<String>,
    on_exceed: Option<String>,
    job: bool,
}

/// The outcome for `pod`, created in `namespace`.
pub fn mutate(pod: &Pod, namespace: &str, places: &Places) -> Outcome {
    let annotations = pod.metadata.annotations.clone().unwrap_or_default();
    let budget = match read_budget(&annotations) {
        Ok(Some(budget)) => budget,
        Ok(None) => return Outcome::Untouched(Vec::new()),
        Err(denial) => return Outcome::Denied(denial),
    };
    if let Err(denial) = within_cap(&budget, namespace, &places.caps) {
        return Outcome::Denied(denial);
    }
    let Some(spec) = &pod.spec else {
        return Outcome::Untouched(Vec::new());
    };
    if namespace.is_empty() && budget.job {
        return Outcome::Denied(format!(
            "annotation {SCOPE}: the review names no namespace, and a job's ledgers are \
             kept per namespace"
        ));
    }
    let init = spec.init_containers.as_deref().unwrap_or_default();
    let lists = [
        ("initContainers", init),
        ("containers", &spec.containers[..]),
    ];
    for name in budget.per_container.keys() {
        if !lists
            .iter()
            .any(|(_, list)| list.iter().any(|c| &c.name == name))
        {
            return Outcome::Denied(format!(
                "annotation {LIMIT_OF}{name}: the pod has no container named {name:?}"
            ));
        }
    }
    if let Err(denial) = no_host_path_over_ours(spec.volumes.as_deref(), places) {
        return Outcome::Denied(denial);
    }
    let mut container_ops = Vec::new();
    let mut budgeted = 0;
    for (list, containers) in lists {
        for (index, container) in containers.iter().enumerate() {
            let own = budget.per_container.get(&container.name);
            let limit = own.or(budget.limit.as_ref());
            let Some(limit) = limit.filter(|_| own.is_some() || uses_gpu(container)) else {
                // Not budgeted: it may not reach the node's directories through ours.
                if let Some(m) = container.volume_mounts.iter().flatten().find(|m| {
                    [LIBRARY_VOLUME, RUNTIME_VOLUME, JOB_VOLUME].contains(&m.name.as_str())
                }) {
                    return Outcome::Denied(format!(
                        "container {:?}: it mounts volume {:?}, which the webhook gives \
                         budgeted containers only",
                        container.name, m.name
                    ));
                }
                continue;
            };
            let at = format!("/spec/{list}/{index}");
            match budget_container(container, &at, limit, &budget, namespace, places) {
                Ok(ops) => container_ops.extend(ops),
                Err(why) => {
                    return Outcome::Denied(format!("container {:?}: {why}", container.name));
                }
            }
            budgeted += 1;
        }
    }
    if budgeted == 0 {
        return Outcome::Untouched(vec![format!(
            "{LIMIT}: no container of this pod uses a GPU (nvidia.com/gpu, a DRA claim, \
             NVIDIA_VISIBLE_DEVICES), so none was budgeted; {LIMIT_OF}<container> budgets \
             one anyway"
        )]);
    }
    let mut ops = match volumes(spec.volumes.as_deref(), budget.job, places) {
        Ok(ops) => ops,
        Err(denial) => return Outcome::Denied(denial),
    };
    ops.extend(container_ops);
    if ops.is_empty() {
        Outcome::Untouched(Vec::new())
    } else {
        Outcome::Patched(ops)
    }
}

/// Each budget the annotations ask for, held to the namespace's cap. A percentage cannot
/// be (the device's size is not known here), nor can `warn` (it admits past any budget).
fn within_cap(budget: &Budget, namespace: &str, caps: &Caps) -> Result<(), String> {
    let Some((cap, source)) = caps.of(namespace) else {
        return Ok(());
    };
    let asked = budget
        .limit
        .iter()
        .map(|limit| (LIMIT.to_string(), limit))
        .chain(
            budget
                .per_container
                .iter()
                .map(|(container, limit)| (format!("{LIMIT_OF}{container}"), limit)),
        );
    for (annotation, text) in asked {
        match quantity::parse_limit(text) {
            Ok(Limit::Bytes(bytes)) if bytes <= cap => {}
            Ok(Limit::Bytes(_)) => {
                return Err(format!(
                    "annotation {annotation}: {text} is above {source}: ask for at most that"
                ));
            }
            Ok(Limit::Percent(_)) => {
                return Err(format!(
                    "annotation {annotation}: {text} is a share of a device whose size the \
                     webhook does not know, so it cannot be held to {source}: give a size"
                ));
            }
            // Checked already; the library's reading refused it.
            Err(error) => return Err(format!("annotation {annotation} is not valid: {error}")),
        }
    }
    if budget
        .on_exceed
        .as_deref()
        .is_some_and(|policy| policy.eq_ignore_ascii_case("warn"))
    {
        return Err(format!(
            "annotation {ON_EXCEED}: warn admits allocations past the budget, so it cannot \
             be held to {source}: use fail or wait:<duration>"
        ));
    }
    Ok(())
}

/// A path with its `.` components and repeated or trailing `/` removed.
fn plain_path(path: &str) -> String {
    let parts: Vec<&str> = path
        .split('/')
        .filter(|part| !part.is_empty() && *part != ".")
        .collect();
    format!("/{}", parts.join("/"))
}

/// Whether one of `a` and `b` is the other or inside it.
fn overlaps(a: &str, b: &str) -> bool {
    let inside = |inner: &str, outer: &str| {
        inner == outer || outer == "/" || inner.starts_with(&format!("{outer}/"))
    };
    inside(a, b) || inside(b, a)
}

/// A hostPath volume of the pod's own over the node's cudabudget directories (or above
/// them, as `/`) would reach every pod's records and the library itself: denied, unless it
/// is the webhook's own volume.
fn no_host_path_over_ours(existing: Option<&[Volume]>, places: &Places) -> Result<(), String> {
    // The library's version directories are beside `current`.
    let library_root = match places.library_dir.rsplit_once('/') {
        Some((parent, _)) if !parent.is_empty() => parent,
        _ => places.library_dir.as_str(),
    };
    let ours = [
        (RUNTIME_VOLUME, places.runtime_dir.as_str()),
        (JOB_VOLUME, places.job_dir.as_str()),
        (LIBRARY_VOLUME, places.library_dir.as_str()),
    ];
    let guarded = [
        (places.runtime_dir.as_str(), "runtime directory"),
        (places.job_dir.as_str(), "job directory"),
        (library_root, "library directory"),
    ];
    for volume in existing.unwrap_or_default() {
        let Some(host) = &volume.host_path else {
            continue;
        };
        let path = plain_path(&host.path);
        if ours.contains(&(volume.name.as_str(), path.as_str())) {
            continue;
        }
        if let Some((dir, what)) = guarded.iter().find(|(dir, _)| overlaps(&path, dir)) {
            return Err(format!(
                "volume {:?} is the node's {}, which is, holds or lies inside the node's \
                 cudabudget {what} {dir}: a pod reaches it only through the webhook's own \
                 mounts",
                volume.name, host.path
            ));
        }
    }
    Ok(())
}

/// The budget of the `cudabudget.io/` annotations; `None` when there are none.
fn read_budget(annotations: &BTreeMap<String, String>) -> Result<Option<Budget>, String> {
    let mut budget = Budget {
        limit: None,
        per_container: BTreeMap::new(),
        scope: None,
        on_exceed: None,
        job: false,
    };
    let mut any = false;
    for (key, value) in annotations {
        let Some(_) = key.strip_prefix(PREFIX) else {
            continue;
        };
        any = true;
        let value = value.trim().to_string();
        let variable = match key.as_str() {
            LIMIT => config::LIMIT,
            SCOPE => config::SCOPE,
            ON_EXCEED => config::ON_EXCEED,
            _ => match key.strip_prefix(LIMIT_OF) {
                Some(container) if !container.is_empty() => config::LIMIT,
                _ => {
                    return Err(format!(
                        "annotation {key} is not one cudabudget knows (known: {LIMIT}, \
                         {LIMIT_OF}<container>, {SCOPE}, {ON_EXCEED})"
                    ));
                }
            },
        };
        // The library's own reading of the variable the annotation becomes.
        if let Err(error) = config::Config::from_vars([(variable, value.as_str())]) {
            return Err(format!(
                "annotation {key} is not valid: {}",
                error.problem()
            ));
        }
        match key.as_str() {
            LIMIT => budget.limit = Some(value),
            SCOPE => {
                budget.job = matches!(config::parse_scope(&value), Ok(config::Scope::Job(_)));
                budget.scope = Some(value);
            }
            ON_EXCEED => budget.on_exceed = Some(value),
            _ => {
                let container = &key[LIMIT_OF.len()..];
                budget.per_container.insert(container.to_string(), value);
            }
        }
    }
    if !any {
        return Ok(None);
    }
    if budget.limit.is_none() && budget.per_container.is_empty() {
        let set: Vec<&str> = [SCOPE, ON_EXCEED]
            .into_iter()
            .filter(|k| annotations.contains_key(*k))
            .collect();
        let (noun, verb) = if set.len() > 1 {
            ("annotations", "are")
        } else {
            ("annotation", "is")
        };
        return Err(format!(
            "{noun} {} {verb} set but no budget is: add {LIMIT} (e.g. 20Gi) or \
             {LIMIT_OF}<container>",
            set.join(" and ")
        ));
    }
    Ok(Some(budget))
}

/// Whether `container` asks for an NVIDIA GPU.
pub fn uses_gpu(container: &Container) -> bool {
    let asks = |amounts: Option<&BTreeMap<String, _>>| {
        amounts.into_iter().flatten().any(
            |(name, amount): (
                &String,
                &k8s_openapi::apimachinery::pkg::api::resource::Quantity,
            )| { is_gpu_resource(name) && !is_zero(&amount.0) },
        )
    };
    let resources = container.resources.as_ref();
    if asks(resources.and_then(|r| r.limits.as_ref()))
        || asks(resources.and_then(|r| r.requests.as_ref()))
    {
        return true;
    }
    // Dynamic resource allocation: the claim's device class is not in the pod, so any
    // claim the container uses counts (a budget on a process without CUDA costs nothing).
    if resources
        .and_then(|r| r.claims.as_ref())
        .is_some_and(|claims| !claims.is_empty())
    {
        return true;
    }
    // The NVIDIA container runtime's variable: empty, `void` and `none` give no device.
    match last(container.env.as_deref(), "NVIDIA_VISIBLE_DEVICES") {
        None => false,
        Some((_, var)) => match &var.value {
            Some(value) => !matches!(value.trim(), "" | "void" | "none"),
            None => var.value_from.is_some(),
        },
    }
}

fn is_gpu_resource(name: &str) -> bool {
    name == "nvidia.com/gpu"
        || name.starts_with("nvidia.com/gpu.")
        || name.starts_with("nvidia.com/mig-")
}

/// A Kubernetes quantity that is zero ("0", "0m", "0.0").
fn is_zero(quantity: &str) -> bool {
    let number = quantity
        .trim()
        .trim_end_matches(|c: char| c.is_ascii_alphabetic());
    number.parse::<f64>().is_ok_and(|n| n == 0.0)
}

/// The last entry named `name` (the one that takes effect) and its index.
fn last<'a>(env: Option<&'a [EnvVar]>, name: &str) -> Option<(usize, &'a EnvVar)> {
    env.unwrap_or_default()
        .iter()
        .enumerate()
        .rev()
        .find(|(_, var)| var.name == name)
}

/// `ours` first, then the other entries of `existing` (either separator), any other copy
/// of the library dropped: two copies would both interpose.
pub fn preload_with(existing: &str, ours: &str) -> String {
    let others = existing.split([':', ' ']).filter(|entry| {
        !entry.is_empty()
            && !std::path::Path::new(entry)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libcudabudget"))
    });
    std::iter::once(ours)
        .chain(others)
        .collect::<Vec<_>>()
        .join(":")
}

/// Whether `name` is a variable the webhook owns in a budgeted container.
fn owned(name: &str) -> bool {
    OWNED_NAMES.contains(&name) || OWNED_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Whether an `envFrom` source with `prefix` could define a variable the webhook owns
/// (its keys are not known here: any key may follow the prefix).
fn could_carry_owned(prefix: &str) -> bool {
    OWNED_PREFIXES
        .iter()
        .any(|p| prefix.starts_with(p) || p.starts_with(prefix))
        || OWNED_NAMES
            .iter()
            .any(|n| n.starts_with(prefix) && n.len() > prefix.len())
}

/// Whether the container's `var` is the entry `ours` (a value, or a `fieldRef`; the API
/// server adds `apiVersion: v1` to a `fieldRef` it stores).
fn same_entry(var: &EnvVar, ours: &Value) -> bool {
    if var.name != ours["name"] {
        return false;
    }
    match (&ours["value"], &var.value_from) {
        (Value::String(value), None) => var.value.as_deref() == Some(value.as_str()),
        (Value::Null, Some(from)) => {
            let field = from.field_ref.as_ref();
            var.value.as_deref().unwrap_or_default().is_empty()
                && from.config_map_key_ref.is_none()
                && from.secret_key_ref.is_none()
                && from.resource_field_ref.is_none()
                && field.is_some_and(|f| {
                    Some(f.field_path.as_str())
                        == ours["valueFrom"]["fieldRef"]["fieldPath"].as_str()
                        && f.api_version.as_deref().is_none_or(|v| v == "v1")
                })
        }
        _ => false,
    }
}

/// The container's own variables and `envFrom` sources held to what the webhook owns:
/// `wanted` (name, entry, where it comes from) are the entries it sets.
fn check_owned(container: &Container, wanted: &[(&str, Value, String)]) -> Result<(), String> {
    for var in container.env.iter().flatten() {
        let name = var.name.as_str();
        if !owned(name) || HARMLESS.contains(&name) {
            continue;
        }
        let own = var
            .value
            .as_deref()
            .filter(|_| var.value_from.is_none())
            .map_or("from valueFrom".to_string(), |v| format!("to {v:?}"));
        if name == "LD_PRELOAD" {
            if var.value_from.is_some() {
                return Err(
                    "its LD_PRELOAD comes from valueFrom, so the library cannot be put first \
                     in it: give LD_PRELOAD as a value"
                        .to_string(),
                );
            }
            continue; // ours is put first in it
        }
        match wanted.iter().find(|(n, _, _)| *n == name) {
            Some((_, ours, _)) if same_entry(var, ours) => {}
            Some((_, ours, from)) => {
                let value = ours["value"]
                    .as_str()
                    .map_or_else(|| ours["valueFrom"].to_string(), |v| format!("{v:?}"));
                return Err(format!(
                    "it sets {name} itself ({own}), where the webhook sets {value} from \
                     {from}: remove one of them"
                ));
            }
            None => {
                return Err(format!(
                    "it sets {name} itself ({own}): the webhook owns the budget variables \
                     of a budgeted container (the cudabudget.io/ annotations set its budget; \
                     only {} may be set by the pod): remove it",
                    HARMLESS.join(" and ")
                ));
            }
        }
    }
    for source in container.env_from.iter().flatten() {
        let prefix = source.prefix.as_deref().unwrap_or_default();
        if !could_carry_owned(prefix) {
            continue;
        }
        let what = match (&source.config_map_ref, &source.secret_ref) {
            (Some(map), _) => format!("configMapRef {:?}", map.name),
            (None, Some(secret)) => format!("secretRef {:?}", secret.name),
            (None, None) => "a source".to_string(),
        };
        let prefix_words = if prefix.is_empty() {
            "no prefix".to_string()
        } else {
            format!("prefix {prefix:?}")
        };
        return Err(format!(
            "its envFrom {what} ({prefix_words}) could set CUDABUDGET_*, \
             CUDA_DEVICE_MEMORY_* or LD_PRELOAD, which the webhook owns in a budgeted \
             container: give it a prefix that cannot begin them (e.g. APP_), or list its \
             variables under env"
        ));
    }
    Ok(())
}

/// The operations that budget one container at `at` (`/spec/containers/0`).
fn budget_container(
    container: &Container,
    at: &str,
    limit: &str,
    budget: &Budget,
    namespace: &str,
    places: &Places,
) -> Result<Vec<Value>, String> {
    let env = container.env.as_deref();
    let mut ops = Vec::new();
    let mut added: Vec<Value> = Vec::new();

    let value = |name: &str, value: String| json!({"name": name, "value": value});
    let field = |name: &str, path: &str| json!({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}});
    let mut wanted: Vec<(&str, Value, String)> = vec![(
        config::LIMIT,
        value(config::LIMIT, limit.to_string()),
        if budget.per_container.contains_key(&container.name) {
            format!("annotation {LIMIT_OF}{}", container.name)
        } else {
            format!("annotation {LIMIT}")
        },
    )];
    if let Some(scope) = &budget.scope {
        wanted.push((
            config::SCOPE,
            value(config::SCOPE, scope.clone()),
            format!("annotation {SCOPE}"),
        ));
    }
    if let Some(policy) = &budget.on_exceed {
        wanted.push((
            config::ON_EXCEED,
            value(config::ON_EXCEED, policy.clone()),
            format!("annotation {ON_EXCEED}"),
        ));
    }
    wanted.push((
        config::RUNTIME_DIR,
        value(config::RUNTIME_DIR, places.runtime_dir.clone()),
        "the pod's own runtime directory, which the exporter reads".to_string(),
    ));
    wanted.push((
        POD_UID,
        field(POD_UID, "metadata.uid"),
        "the downward API (the pod's runtime directory is named by it)".to_string(),
    ));
    if budget.job {
        wanted.push((
            config::JOB_DIR,
            value(config::JOB_DIR, places.job_dir.clone()),
            "the namespace's job directory, shared by the job's pods".to_string(),
        ));
    }
    check_owned(container, &wanted)?;

    let library = places.library();
    match last(env, "LD_PRELOAD") {
        None => added.push(json!({"name": "LD_PRELOAD", "value": library})),
        Some((index, var)) => {
            let existing = var.value.as_deref().unwrap_or_default();
            let merged = preload_with(existing, &library);
            if merged != existing {
                ops.push(
                    json!({"op": "replace", "path": format!("{at}/env/{index}/value"),
                                "value": merged}),
                );
            }
        }
    }
    for (name, entry, _) in wanted {
        // Any entry of the name is ours already (check_owned).
        if last(env, name).is_none() {
            added.push(entry);
        }
    }
    // The names the records carry (the exporter's namespace, pod and container labels),
    // unless the container names them itself.
    for (name, entry) in [
        ("POD_NAME", field("POD_NAME", "metadata.name")),
        (
            "POD_NAMESPACE",
            field("POD_NAMESPACE", "metadata.namespace"),
        ),
        (
            "CONTAINER_NAME",
            value("CONTAINER_NAME", container.name.clone()),
        ),
    ] {
        if last(env, name).is_none() {
            added.push(entry);
        }
    }
    check_environment(env, &added)?;
    match env {
        None => ops.push(json!({"op": "add", "path": format!("{at}/env"), "value": added})),
        Some(_) => ops.extend(
            added
                .into_iter()
                .map(|var| json!({"op": "add", "path": format!("{at}/env/-"), "value": var})),
        ),
    }

    let mut mounts = vec![
        (
            mount(LIBRARY_VOLUME, &places.library_mount, true, Sub::None),
            "the cudabudget library",
        ),
        (
            mount(
                RUNTIME_VOLUME,
                &places.runtime_dir,
                false,
                Sub::Expr(format!("{PODS}/$({POD_UID})")),
            ),
            "the pod's runtime directory",
        ),
    ];
    if budget.job {
        mounts.push((
            mount(
                JOB_VOLUME,
                &places.job_dir,
                false,
                Sub::Path(format!("{NAMESPACES}/{namespace}")),
            ),
            "the namespace's job directory",
        ));
    }
    let existing = container.volume_mounts.as_deref().unwrap_or_default();
    for m in existing {
        let path = plain_path(&m.mount_path);
        let ours = mounts.iter().find(|(o, _)| o.mount_path == path);
        let same = ours.is_some_and(|(o, _)| {
            o.name == m.name
                && o.sub_path == m.sub_path
                && o.sub_path_expr == m.sub_path_expr
                && o.read_only.unwrap_or(false) == m.read_only.unwrap_or(false)
        });
        if same {
            continue;
        }
        if let Some((o, what)) = ours {
            return Err(format!(
                "it mounts volume {:?} at {}, where the webhook mounts {what}",
                m.name, o.mount_path
            ));
        }
        if [LIBRARY_VOLUME, RUNTIME_VOLUME, JOB_VOLUME].contains(&m.name.as_str()) {
            return Err(format!(
                "it mounts volume {:?} at {}: the webhook mounts it itself, only at its own \
                 place",
                m.name, m.mount_path
            ));
        }
    }
    let new_mounts: Vec<Value> = mounts
        .into_iter()
        .filter(|(o, _)| {
            !existing
                .iter()
                .any(|m| plain_path(&m.mount_path) == o.mount_path)
        })
        .map(|(o, _)| serde_json::to_value(o).expect("a VolumeMount serializes"))
        .collect();
    match container.volume_mounts {
        None => ops.push(json!({"op": "add", "path": format!("{at}/volumeMounts"),
                                "value": new_mounts})),
        Some(_) => ops.extend(
            new_mounts
                .into_iter()
                .map(|m| json!({"op": "add", "path": format!("{at}/volumeMounts/-"), "value": m})),
        ),
    }
    Ok(ops)
}

/// Which part of a volume a mount shows.
enum Sub {
    None,
    Path(String),
    Expr(String),
}

fn mount(volume: &str, path: &str, read_only: bool, sub: Sub) -> VolumeMount {
    let mut m = VolumeMount {
        name: volume.to_string(),
        mount_path: path.to_string(),
        ..Default::default()
    };
    if read_only {
        m.read_only = Some(true);
    }
    match sub {
        Sub::None => {}
        Sub::Path(path) => m.sub_path = Some(path),
        Sub::Expr(expr) => m.sub_path_expr = Some(expr),
    }
    m
}

/// The container's budget variables as the library will read them (the last entry of a
/// name wins in Kubernetes, the first in the library's reading: hence reversed); a value
/// the library would refuse is refused here. Values from `valueFrom` are not known yet.
fn check_environment(env: Option<&[EnvVar]>, added: &[Value]) -> Result<(), String> {
    let mut vars: Vec<(String, String)> = env
        .unwrap_or_default()
        .iter()
        .filter_map(|v| Some((v.name.clone(), v.value.clone()?)))
        .collect();
    vars.extend(added.iter().filter_map(|v| {
        Some((
            v["name"].as_str()?.to_string(),
            v["value"].as_str()?.to_string(),
        ))
    }));
    vars.reverse();
    config::Config::from_vars(vars.iter().map(|(n, v)| (n.as_str(), v.as_str())))
        .map(|_| ())
        .map_err(|error| format!("its environment is not valid: {}", error.problem()))
}

/// The pod's volumes the containers mount: added where missing; one of the same name that
/// is not the same node directory is a denial.
fn volumes(existing: Option<&[Volume]>, job: bool, places: &Places) -> Result<Vec<Value>, String> {
    let mut wanted = vec![
        (LIBRARY_VOLUME, places.library_dir.as_str()),
        (RUNTIME_VOLUME, places.runtime_dir.as_str()),
    ];
    if job {
        wanted.push((JOB_VOLUME, places.job_dir.as_str()));
    }
    let mut new = Vec::new();
    for (name, path) in wanted {
        match existing.unwrap_or_default().iter().find(|v| v.name == name) {
            None => {
                new.push(json!({"name": name, "hostPath": {"path": path, "type": "Directory"}}))
            }
            Some(v) if v.host_path.as_ref().is_some_and(|h| h.path == path) => {}
            Some(_) => {
                return Err(format!(
                    "the pod has a volume named {name:?} that is not the node's {path}: \
                     rename it"
                ));
            }
        }
    }
    Ok(match existing {
        None if new.is_empty() => Vec::new(),
        None => vec![json!({"op": "add", "path": "/spec/volumes", "value": new})],
        Some(_) => new
            .into_iter()
            .map(|v| json!({"op": "add", "path": "/spec/volumes/-", "value": v}))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ours_goes_first_in_ld_preload_and_only_once() {
        let ours = "/opt/cudabudget/libcudabudget.so";
        assert_eq!(preload_with("", ours), ours);
        assert_eq!(
            preload_with("/a.so /b.so", ours),
            format!("{ours}:/a.so:/b.so")
        );
        assert_eq!(
            preload_with("/a.so:/usr/lib/libcudabudget.so", ours),
            format!("{ours}:/a.so")
        );
        assert_eq!(
            preload_with(&format!("{ours}:/a.so"), ours),
            format!("{ours}:/a.so")
        );
    }

    #[test]
    fn a_zero_gpu_count_is_no_gpu() {
        assert!(is_zero("0") && is_zero("0m") && !is_zero("1") && !is_zero("500m"));
    }
}
