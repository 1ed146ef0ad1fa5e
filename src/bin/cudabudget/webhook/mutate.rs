//! What the webhook does to a pod: its `cudabudget.io/` annotations read and checked, and
//! the JSONPatch that budgets each container that uses a GPU. Pure: a pod in, a patch or
//! a denial out.
//!
//! A container uses a GPU when its resources ask for a non-zero `nvidia.com/gpu` (or a
//! renamed share of it, `nvidia.com/gpu.*`, or a MIG slice, `nvidia.com/mig-*`), when its
//! `NVIDIA_VISIBLE_DEVICES` names devices (not empty, `void` or `none`), or when a
//! `cudabudget.io/limit.<container>` annotation names it. Init containers follow the same
//! rules: one that uses a GPU is budgeted like the others.
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

use crate::config;

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

/// Where things are on the node and in the container.
#[derive(Clone, Debug)]
pub struct Places {
    /// The node's library directory (`<libraryDir>/current`), a hostPath.
    pub library_dir: String,
    /// Where containers see it (read-only); `LD_PRELOAD` names `libcudabudget.so` there.
    pub library_mount: String,
    /// The node-wide runtime directory (`CUDABUDGET_RUNTIME_DIR`), at the same path.
    pub runtime_dir: String,
    /// The node-wide job directory (`CUDABUDGET_JOB_DIR`), mounted for `job:` scopes.
    pub job_dir: String,
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

/// The outcome for `pod`.
pub fn mutate(pod: &Pod, places: &Places) -> Outcome {
    let annotations = pod.metadata.annotations.clone().unwrap_or_default();
    let budget = match read_budget(&annotations) {
        Ok(Some(budget)) => budget,
        Ok(None) => return Outcome::Untouched(Vec::new()),
        Err(denial) => return Outcome::Denied(denial),
    };
    let Some(spec) = &pod.spec else {
        return Outcome::Untouched(Vec::new());
    };
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
    let mut container_ops = Vec::new();
    let mut budgeted = 0;
    for (list, containers) in lists {
        for (index, container) in containers.iter().enumerate() {
            let own = budget.per_container.get(&container.name);
            let Some(limit) = own.or(budget.limit.as_ref()) else {
                continue;
            };
            if own.is_none() && !uses_gpu(container) {
                continue;
            }
            let at = format!("/spec/{list}/{index}");
            match budget_container(container, &at, limit, &budget, places) {
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
            "{LIMIT}: no container of this pod uses a GPU (nvidia.com/gpu, \
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

/// The operations that budget one container at `at` (`/spec/containers/0`).
fn budget_container(
    container: &Container,
    at: &str,
    limit: &str,
    budget: &Budget,
    places: &Places,
) -> Result<Vec<Value>, String> {
    let env = container.env.as_deref();
    let mut ops = Vec::new();
    let mut added: Vec<Value> = Vec::new();

    let library = places.library();
    match last(env, "LD_PRELOAD") {
        None => added.push(json!({"name": "LD_PRELOAD", "value": library})),
        Some((_, var)) if var.value_from.is_some() => {
            return Err(
                "its LD_PRELOAD comes from valueFrom, so the library cannot be put first in \
                 it: give LD_PRELOAD as a value"
                    .to_string(),
            );
        }
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

    let mut wanted: Vec<(&str, String, String)> = vec![(
        config::LIMIT,
        limit.to_string(),
        if budget.per_container.contains_key(&container.name) {
            format!("annotation {LIMIT_OF}{}", container.name)
        } else {
            format!("annotation {LIMIT}")
        },
    )];
    if let Some(scope) = &budget.scope {
        wanted.push((config::SCOPE, scope.clone(), format!("annotation {SCOPE}")));
    }
    if let Some(policy) = &budget.on_exceed {
        wanted.push((
            config::ON_EXCEED,
            policy.clone(),
            format!("annotation {ON_EXCEED}"),
        ));
    }
    wanted.push((
        config::RUNTIME_DIR,
        places.runtime_dir.clone(),
        "the node's runtime directory, where the exporter reads".to_string(),
    ));
    if budget.job {
        wanted.push((
            config::JOB_DIR,
            places.job_dir.clone(),
            "the node's job directory, shared by the job's pods".to_string(),
        ));
    }
    for (name, value, from) in wanted {
        match last(env, name) {
            None => added.push(json!({"name": name, "value": value})),
            Some((_, var)) if var.value_from.is_none() && var.value.as_deref() == Some(&value) => {}
            Some((_, var)) => {
                let own = var
                    .value
                    .as_deref()
                    .map_or("from valueFrom".to_string(), |v| format!("to {v:?}"));
                return Err(format!(
                    "it sets {name} itself ({own}), where the webhook sets {value:?} from \
                     {from}: remove one of them"
                ));
            }
        }
    }
    // The names the records carry (the exporter's namespace, pod and container labels),
    // unless the container names them itself.
    for (name, value) in [
        (
            "POD_NAME",
            json!({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
        ),
        (
            "POD_NAMESPACE",
            json!({"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}),
        ),
        (
            "CONTAINER_NAME",
            json!({"name": "CONTAINER_NAME", "value": container.name}),
        ),
    ] {
        if last(env, name).is_none() {
            added.push(value);
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
            LIBRARY_VOLUME,
            places.library_mount.clone(),
            true,
            "the cudabudget library",
        ),
        (
            RUNTIME_VOLUME,
            places.runtime_dir.clone(),
            false,
            "the runtime directory",
        ),
    ];
    if budget.job {
        mounts.push((
            JOB_VOLUME,
            places.job_dir.clone(),
            false,
            "the job directory",
        ));
    }
    let existing = container.volume_mounts.as_deref().unwrap_or_default();
    let mut new_mounts = Vec::new();
    for (volume, path, read_only, what) in mounts {
        match existing
            .iter()
            .find(|m| m.mount_path.trim_end_matches('/') == path)
        {
            None => new_mounts.push(mount(volume, &path, read_only)),
            Some(m) if m.name == volume => {}
            Some(m) => {
                return Err(format!(
                    "it mounts volume {:?} at {path}, where the webhook mounts {what}",
                    m.name
                ));
            }
        }
    }
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

fn mount(volume: &str, path: &str, read_only: bool) -> Value {
    let mut m = VolumeMount {
        name: volume.to_string(),
        mount_path: path.to_string(),
        ..Default::default()
    };
    if read_only {
        m.read_only = Some(true);
    }
    serde_json::to_value(m).expect("a VolumeMount serializes")
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
