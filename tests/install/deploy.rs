//! The recipes in `deploy/`: every YAML file parses, the manifests say what their READMEs
//! promise (a budget per container, one GPU shared by two budgets), and the shell entry
//! points behave as documented: `deploy/docker/entrypoint.sh` runs a command under the
//! environment's budget or refuses it before it starts, and the Slurm TaskProlog prints
//! the environment a task gets or stops the task.
//!
//! The shell scripts run with the CLI and library cargo built for this run, laid out as
//! they are installed (`/opt/cudabudget`), and the fake driver of `tests/fake_driver`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use yaml_rust2::{Yaml, YamlLoader};

const CLI: &str = env!("CARGO_BIN_EXE_cudabudget");

const GI: u64 = 1 << 30;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn deploy() -> PathBuf {
    repo().join("deploy")
}

/// Every file under `dir`, recursively, sorted.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                pending.push(path);
            } else {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

fn has_extension(path: &Path, extensions: &[&str]) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| extensions.contains(&e))
}

/// Every document of a YAML file; a parse error fails the test with the file's name.
fn load(path: &Path) -> Vec<Yaml> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    YamlLoader::load_from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The one document of `deploy/<relative>`.
fn manifest(relative: &str) -> Yaml {
    let mut documents = load(&deploy().join(relative));
    assert_eq!(documents.len(), 1, "{relative}: one document expected");
    documents.remove(0)
}

fn text(node: &Yaml) -> Option<&str> {
    node.as_str()
}

fn list(node: &Yaml) -> &[Yaml] {
    node.as_vec().map(Vec::as_slice).unwrap_or(&[])
}

/// The pod spec of a Pod, or of the template of a Deployment or DaemonSet.
fn pod_spec(document: &Yaml) -> &Yaml {
    match text(&document["kind"]) {
        Some("Pod") => &document["spec"],
        Some("Deployment" | "DaemonSet") => &document["spec"]["template"]["spec"],
        other => panic!("no pod spec in a {other:?}"),
    }
}

fn env_value<'a>(container: &'a Yaml, name: &str) -> Option<&'a str> {
    list(&container["env"])
        .iter()
        .find(|variable| text(&variable["name"]) == Some(name))
        .map(|variable| text(&variable["value"]).unwrap_or_else(|| panic!("{name}: not a string")))
}

/// A budget as the manifests write it: a whole number of Gi or Mi.
fn is_binary_quantity(value: &str) -> bool {
    ["Gi", "Mi"].iter().any(|unit| {
        value
            .strip_suffix(unit)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// The volume of `spec` mounted at `path` in `container`.
fn volume_at<'a>(spec: &'a Yaml, container: &Yaml, path: &str) -> Option<&'a Yaml> {
    let mount = list(&container["volumeMounts"])
        .iter()
        .find(|mount| text(&mount["mountPath"]) == Some(path))?;
    list(&spec["volumes"])
        .iter()
        .find(|volume| volume["name"] == mount["name"])
}

#[test]
fn every_yaml_file_under_deploy_parses() {
    let files: Vec<PathBuf> = files_under(&deploy())
        .into_iter()
        .filter(|path| has_extension(path, &["yml", "yaml"]))
        // A Helm chart's templates are YAML only once rendered (tests/helm_chart.rs).
        .filter(|path| {
            !path.parent().is_some_and(|dir| {
                dir.ends_with("templates") && dir.starts_with(deploy().join("helm"))
            })
        })
        .collect();
    let names: BTreeSet<String> = files
        .iter()
        .map(|path| path.strip_prefix(deploy()).unwrap().display().to_string())
        .collect();
    for expected in [
        "compose/docker-compose.yml",
        "kubernetes/pod.yaml",
        "kubernetes/deployment.yaml",
        "kubernetes/daemonset.yaml",
        "kubernetes/hami-pod.yaml",
    ] {
        assert!(
            names.contains(expected),
            "{expected} not found in {names:?}"
        );
    }
    for file in &files {
        let documents = load(file);
        assert!(!documents.is_empty(), "{}: no document", file.display());
        for document in &documents {
            assert!(
                document.is_hash(),
                "{}: a document is not a mapping",
                file.display()
            );
        }
    }
}

#[test]
fn every_container_of_the_pod_and_the_deployment_has_its_own_budget() {
    for file in ["kubernetes/pod.yaml", "kubernetes/deployment.yaml"] {
        let document = manifest(file);
        let spec = pod_spec(&document);
        let containers = list(&spec["containers"]);
        assert!(
            containers.len() >= 2,
            "{file}: a budget per container needs containers"
        );
        let mut budgets = BTreeSet::new();
        for container in containers {
            let name = text(&container["name"]).expect("container name");
            let budget = env_value(container, "CUDABUDGET_LIMIT")
                .unwrap_or_else(|| panic!("{file}: container {name} has no CUDABUDGET_LIMIT"));
            assert!(
                is_binary_quantity(budget),
                "{file}/{name}: CUDABUDGET_LIMIT={budget:?}"
            );
            budgets.insert(budget);
            // Started through the entrypoint, which refuses to run unbudgeted...
            assert_eq!(
                list(&container["command"]),
                [Yaml::String("/opt/cudabudget/entrypoint.sh".into())],
                "{file}/{name}: command"
            );
            assert!(
                !list(&container["args"]).is_empty(),
                "{file}/{name}: no program"
            );
            // ...from the node's installation, mounted read-only.
            let volume = volume_at(spec, container, "/opt/cudabudget")
                .unwrap_or_else(|| panic!("{file}/{name}: /opt/cudabudget not mounted"));
            assert_eq!(text(&volume["hostPath"]["path"]), Some("/opt/cudabudget"));
            assert_eq!(text(&volume["hostPath"]["type"]), Some("Directory"));
            let mount = list(&container["volumeMounts"])
                .iter()
                .find(|m| text(&m["mountPath"]) == Some("/opt/cudabudget"))
                .unwrap();
            assert_eq!(mount["readOnly"].as_bool(), Some(true), "{file}/{name}");
            assert_eq!(
                container["resources"]["limits"]["nvidia.com/gpu"].as_i64(),
                Some(1),
                "{file}/{name}: one GPU"
            );
        }
        assert_eq!(
            budgets.len(),
            containers.len(),
            "{file}: budgets {budgets:?}"
        );
    }
}

#[test]
fn the_hami_pod_is_budgeted_by_hami_alone() {
    let document = manifest("kubernetes/hami-pod.yaml");
    for container in list(&pod_spec(&document)["containers"]) {
        for variable in list(&container["env"]) {
            let name = text(&variable["name"]).unwrap();
            assert!(
                !name.starts_with("CUDABUDGET_LIMIT"),
                "{name} would replace HAMi's budget"
            );
        }
        assert_eq!(env_value(container, "CUDA_DISABLE_CONTROL"), Some("true"));
        let gpumem = container["resources"]["limits"]["nvidia.com/gpumem"].as_i64();
        assert!(
            gpumem.is_some_and(|m| m > 0),
            "nvidia.com/gpumem: {gpumem:?}"
        );
        assert_eq!(
            text(&container["command"][0]),
            Some("/opt/cudabudget/entrypoint.sh")
        );
    }
}

#[test]
fn the_daemonset_installs_the_three_files_into_the_hosts_opt_cudabudget() {
    let document = manifest("kubernetes/daemonset.yaml");
    assert_eq!(text(&document["kind"]), Some("DaemonSet"));
    let spec = pod_spec(&document);
    let install = &list(&spec["initContainers"])[0];
    let volume = volume_at(spec, install, "/host/opt/cudabudget").expect("host directory mounted");
    assert_eq!(text(&volume["hostPath"]["path"]), Some("/opt/cudabudget"));
    let script = text(&install["args"][0]).expect("install script");
    for file in ["libcudabudget.so", "cudabudget", "entrypoint.sh"] {
        assert!(script.contains(file), "{file} is not installed: {script}");
    }
    assert!(
        script.contains("\"$dst/entrypoint.sh\" --check"),
        "{script}"
    );
    assert!(!list(&spec["containers"]).is_empty());
}

#[test]
fn the_compose_file_shares_one_gpu_between_two_budgets() {
    let compose_dir = deploy().join("compose");
    let document = manifest("compose/docker-compose.yml");
    let services = document["services"].as_hash().expect("services");
    assert_eq!(services.len(), 2, "a trainer and a JAX service");
    let mut budgets = BTreeSet::new();
    let mut gpus = BTreeSet::new();
    for (name, service) in services {
        let name = text(name).unwrap();
        let budget = text(&service["environment"]["CUDABUDGET_LIMIT"])
            .unwrap_or_else(|| panic!("{name}: no CUDABUDGET_LIMIT"));
        assert!(is_binary_quantity(budget), "{name}: {budget:?}");
        budgets.insert(budget);

        let devices = list(&service["deploy"]["resources"]["reservations"]["devices"]);
        assert_eq!(devices.len(), 1, "{name}: one GPU reservation");
        assert_eq!(text(&devices[0]["driver"]), Some("nvidia"), "{name}");
        assert!(list(&devices[0]["capabilities"]).contains(&Yaml::String("gpu".into())));
        let ids: Vec<&str> = list(&devices[0]["device_ids"])
            .iter()
            .filter_map(text)
            .collect();
        assert_eq!(ids.len(), 1, "{name}: one card");
        gpus.insert(ids[0]);

        // Built from deploy/docker, with the repository as the context.
        let build = &service["build"];
        assert_eq!(
            text(&build["dockerfile"]),
            Some("deploy/docker/Dockerfile"),
            "{name}"
        );
        let context = compose_dir.join(text(&build["context"]).unwrap());
        assert_eq!(
            context.canonicalize().unwrap(),
            repo().canonicalize().unwrap(),
            "{name}: build context"
        );
        assert!(
            text(&build["args"]["BASE"]).is_some(),
            "{name}: no BASE image"
        );
        for volume in list(&service["volumes"]) {
            let source = text(volume).unwrap().split(':').next().unwrap();
            assert!(
                compose_dir.join(source).is_file(),
                "{name}: {source} does not exist"
            );
        }
    }
    assert_eq!(budgets.len(), 2, "two different budgets: {budgets:?}");
    assert_eq!(gpus.len(), 1, "both on the same GPU: {gpus:?}");
}

#[test]
fn the_shell_scripts_parse_and_the_python_programs_compile() {
    for file in files_under(&deploy()) {
        let check = if has_extension(&file, &["sh"]) {
            Command::new("sh").arg("-n").arg(&file).output()
        } else if has_extension(&file, &["sbatch"]) {
            Command::new("bash").arg("-n").arg(&file).output()
        } else if has_extension(&file, &["py"]) {
            // compile() without writing __pycache__ into deploy/.
            Command::new("python3")
                .args([
                    "-c",
                    "import sys; compile(open(sys.argv[1]).read(), sys.argv[1], 'exec')",
                ])
                .arg(&file)
                .output()
        } else {
            continue;
        };
        let out = check.expect("the checker runs");
        assert!(out.status.success(), "{}: {}", file.display(), stderr(&out));
    }
}

// --- the shell entry points, with the CLI and library of this build ---

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Places `from` at `to`: a hard link where possible (never open for writing, so no
/// ETXTBSY when it is executed while another test thread forks), else a copy.
fn place(from: &Path, to: &Path) {
    crate::util::place(from, to);
}

/// A fresh directory laid out like the installation: `cudabudget`, `libcudabudget.so` and
/// `entrypoint.sh` (each only if asked for).
fn install_dir(test: &str, with_library: bool) -> PathBuf {
    // Closed to other users all the way from `/` (the entrypoint's `run` refuses a
    // library anywhere else), wherever the clone lies.
    let dir = crate::util::closed_binary_dir()
        .join(format!("deploy-{test}"))
        .join("opt-cudabudget");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    place(Path::new(CLI), &dir.join("cudabudget"));
    if with_library {
        place(&crate::util::lib_path(), &dir.join("libcudabudget.so"));
    }
    std::fs::copy(
        deploy().join("docker/entrypoint.sh"),
        dir.join("entrypoint.sh"),
    )
    .unwrap();
    dir
}

/// `sh <script> args...` with an environment free of the developer's budget variables
/// and preloads, plus `envs`. Run through `sh` so the scripts' own mode bits and the
/// copy's do not matter. Retries an exec that races a fork (ETXTBSY), as the CLI's tests do (tests/util/cli.rs).
fn sh(script: &Path, args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut command = Command::new("sh");
    for (name, _) in std::env::vars_os() {
        let name_text = name.to_string_lossy();
        if name_text.starts_with("CUDABUDGET_")
            || name_text.starts_with("CUDA_DEVICE_MEMORY_LIMIT")
            || name_text.starts_with("SLURM_")
            || name_text == "LD_PRELOAD"
            || name_text == "CUDA_VISIBLE_DEVICES"
        {
            command.env_remove(&name);
        }
    }
    crate::util::isolate(&mut command)
        .arg(script)
        .args(args)
        .envs(envs.iter().copied());
    let mut tries = 0;
    loop {
        let out = command.output().expect("sh runs");
        let busy = stderr(&out).contains("Text file busy");
        if !busy || tries == 100 {
            return out;
        }
        tries += 1;
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A path no other test uses; the refused commands would create it.
fn marker(dir: &Path) -> PathBuf {
    let path = dir.join("ran");
    let _ = std::fs::remove_file(&path);
    path
}

/// Runs the entrypoint with `touch <marker>` (or no command) and asserts it was refused
/// with `status`, one line on stderr, and that nothing ran.
fn assert_entrypoint_refuses(
    dir: &Path,
    envs: &[(&str, &str)],
    with_command: bool,
    status: i32,
) -> String {
    let marker = marker(dir);
    let marker_arg = marker.to_str().unwrap();
    let args: &[&str] = if with_command {
        &["touch", marker_arg]
    } else {
        &[]
    };
    let out = sh(&dir.join("entrypoint.sh"), args, envs);
    let message = stderr(&out);
    assert_eq!(out.status.code(), Some(status), "{envs:?}: {message}");
    assert!(!marker.exists(), "the command ran despite: {message}");
    assert!(message.starts_with("cudabudget"), "{message}");
    assert_eq!(message.trim_end().lines().count(), 1, "{message}");
    message
}

#[test]
fn the_entrypoint_check_passes_where_the_library_loads() {
    let dir = install_dir("check", true);
    let out = sh(&dir.join("entrypoint.sh"), &["--check"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("works here"), "{}", stdout(&out));
}

#[test]
fn the_entrypoint_runs_the_command_with_the_library_and_the_budget() {
    let dir = install_dir("budget", true);
    let library = dir.join("libcudabudget.so").canonicalize().unwrap();
    let show = r#"printf '%s\n%s\n%s\n' "$LD_PRELOAD" "$CUDABUDGET_LIMIT" "$CUDABUDGET_LIMIT_1""#;
    let out = sh(
        &dir.join("entrypoint.sh"),
        &["sh", "-c", show],
        &[("CUDABUDGET_LIMIT", "8Gi"), ("CUDABUDGET_LIMIT_1", "4Gi")],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let expected = format!("{}\n8Gi\n4Gi\n", library.display());
    assert_eq!(stdout(&out), expected);

    // HAMi's variable alone is a budget too.
    let marker = marker(&dir);
    let out = sh(
        &dir.join("entrypoint.sh"),
        &["touch", marker.to_str().unwrap()],
        &[("CUDA_DEVICE_MEMORY_LIMIT_0", "8192m")],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(marker.exists());
}

#[test]
fn the_entrypoint_refuses_without_a_valid_budget_or_a_command() {
    let dir = install_dir("refusals", true);
    let message = assert_entrypoint_refuses(&dir, &[], true, 125);
    assert!(
        message.contains("no budget in the environment"),
        "{message}"
    );
    let message = assert_entrypoint_refuses(&dir, &[("CUDA_DEVICE_MEMORY_LIMIT", "0")], true, 125);
    assert!(message.contains("no budget given"), "{message}");
    let message = assert_entrypoint_refuses(&dir, &[("CUDABUDGET_LIMIT", "10XB")], true, 125);
    assert!(message.contains("CUDABUDGET_LIMIT=\"10XB\""), "{message}");
    let message = assert_entrypoint_refuses(&dir, &[("CUDABUDGET_LIMIT", "8Gi")], false, 125);
    assert!(message.contains("no command given"), "{message}");
}

#[test]
fn the_entrypoint_refuses_when_the_library_is_missing_or_cannot_be_loaded() {
    let dir = install_dir("no-library", false);
    let message = assert_entrypoint_refuses(&dir, &[("CUDABUDGET_LIMIT", "8Gi")], true, 125);
    assert!(message.contains("is missing"), "{message}");
    let out = sh(&dir.join("entrypoint.sh"), &["--check"], &[]);
    assert_eq!(out.status.code(), Some(125), "--check: {}", stderr(&out));

    let junk = dir.join("libjunk.so");
    std::fs::write(&junk, b"not an ELF file").unwrap();
    let message = assert_entrypoint_refuses(
        &dir,
        &[
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("CUDABUDGET_LIB", junk.to_str().unwrap()),
        ],
        true,
        125,
    );
    assert!(message.contains("cannot be preloaded"), "{message}");
}

#[test]
fn a_command_the_entrypoint_runs_is_budgeted() {
    let dir = install_dir("enforced", true);
    let script = r#"
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
ctx = ctypes.c_void_p()
assert cuda.cuInit(0) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
free, total = ctypes.c_size_t(), ctypes.c_size_t()
assert cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
p = ctypes.c_uint64()
fits = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(5 << 30))
over = cuda.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(4 << 30))
print(total.value, fits, over)
"#;
    let out = sh(
        &dir.join("entrypoint.sh"),
        &["python3", "-c", script],
        &[
            ("CUDABUDGET_LIMIT", "8Gi"),
            ("CUDABUDGET_LOG", "off"),
            ("LD_LIBRARY_PATH", cudabudget_fake_driver::FAKE_DRIVER_DIR),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    // The fake card has 80 GiB; the process sees its 8 GiB and is refused past them.
    assert_eq!(stdout(&out).trim(), format!("{} 0 2", 8 * GI));
}

/// The TaskProlog with its site setting INSTALL_DIR pointed at `dir`, as an admin edits it,
/// and its `SCONTROL` at a stand-in for slurmctld's answer: it prints `$CB_SCONTROL_SAYS`
/// (nothing when unset) and exits with `$CB_SCONTROL_RC` (0), after writing its arguments
/// to `<dir>/scontrol.args`.
fn taskprolog(dir: &Path) -> PathBuf {
    let original = std::fs::read_to_string(deploy().join("slurm/taskprolog.sh")).unwrap();
    let script = dir.parent().unwrap().join("taskprolog.sh");
    let scontrol = dir.parent().unwrap().join("scontrol");
    std::fs::write(
        &scontrol,
        format!(
            "#!/bin/sh\necho \"$@\" > {}/scontrol.args\nprintf '%s\\n' \"${{CB_SCONTROL_SAYS:-}}\"\nexit \"${{CB_SCONTROL_RC:-0}}\"\n",
            dir.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &scontrol,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let mut edited = original;
    for (setting, value) in [
        ("INSTALL_DIR=/opt/cudabudget\n", dir),
        ("SCONTROL=/usr/bin/scontrol\n", scontrol.as_path()),
    ] {
        assert!(
            edited.contains(setting),
            "the site setting {setting:?} moved"
        );
        let name = setting.split('=').next().unwrap();
        edited = edited.replace(setting, &format!("{name}={}\n", value.display()));
    }
    std::fs::write(&script, edited).unwrap();
    script
}

#[test]
fn the_taskprolog_turns_a_steps_gpumem_into_the_budget_its_tasks_share_whatever_the_job_sets() {
    let dir = install_dir("taskprolog-gpumem", true);
    let prolog = taskprolog(&dir);
    let preload = format!("export LD_PRELOAD={}/libcudabudget.so", dir.display());
    let step = "StepId=7.0 UserId=1000 State=RUNNING NodeList=n1 Nodes=1 Tasks=1 Name=python3";

    // A step's count per node (slurmctld's TresPerNode) is its budget, shared by its
    // tasks on the node (a job scope of the step's own); the job's own budget and scope
    // go, and shards beside it do not count.
    let says = format!("{step} TresPerStep=cpu:1 TresPerNode=gres:shard:1,gres:gpumem:20");
    let out = sh(
        &prolog,
        &[],
        &[
            ("SLURM_JOB_ID", "7"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_SHARDS_ON_NODE", "1"),
            ("CUDABUDGET_LIMIT", "1Ti"),
            ("CUDABUDGET_SCOPE", "job:mine"),
            ("CB_SCONTROL_SAYS", &says),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        format!(
            "unset CUDABUDGET_LIMIT\nexport CUDABUDGET_LIMIT=20Gi\n\
             export CUDABUDGET_SCOPE=job:slurm-7.0\n{preload}\n"
        )
    );
    let asked = std::fs::read_to_string(dir.join("scontrol.args")).unwrap();
    assert_eq!(asked, "-o show step 7.0\n");

    // The batch script (no step id): its job's count, a typed one too.
    let says = "JobId=7 JobState=RUNNING TresPerNode=gres:gpumem:big:48 Command=/x/gpumem.sh";
    let out = sh(
        &prolog,
        &[],
        &[("SLURM_JOB_ID", "7"), ("CB_SCONTROL_SAYS", says)],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        format!(
            "export CUDABUDGET_LIMIT=48Gi\nexport CUDABUDGET_SCOPE=job:slurm-7.batch\n{preload}\n"
        )
    );
    let asked = std::fs::read_to_string(dir.join("scontrol.args")).unwrap();
    assert_eq!(asked, "-o show job 7\n");
    // Slurm's reserved step number for a batch script is its job too.
    let out = sh(
        &prolog,
        &[],
        &[
            ("SLURM_JOB_ID", "7"),
            ("SLURM_STEP_ID", "4294967291"),
            ("CB_SCONTROL_SAYS", says),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let asked = std::fs::read_to_string(dir.join("scontrol.args")).unwrap();
    assert_eq!(asked, "-o show job 7\n");

    // A step without gpumem is left to the other rules (here: shards).
    let says = format!("{step} TresPerNode=gres:shard:2 Name=gpumem");
    let out = sh(
        &prolog,
        &[],
        &[
            ("SLURM_JOB_ID", "7"),
            ("SLURM_STEP_ID", "1"),
            ("SLURM_SHARDS_ON_NODE", "2"),
            ("CB_SCONTROL_SAYS", &says),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        format!("export CUDABUDGET_LIMIT=16Gi\n{preload}\n")
    );
}

#[test]
fn the_taskprolog_stops_a_task_whose_gpumem_it_cannot_learn() {
    let dir = install_dir("taskprolog-gpumem-refusals", true);
    let prolog = taskprolog(&dir);
    for (envs, reason) in [
        (
            &[
                (
                    "CB_SCONTROL_SAYS",
                    "slurm_load_jobs error: Unable to contact slurm controller",
                ),
                ("CB_SCONTROL_RC", "1"),
            ][..],
            "cannot ask slurmctld for the gpumem of step 7.0: slurm_load_jobs error",
        ),
        (
            &[("CB_SCONTROL_SAYS", "StepId=7.0 TresPerTask=gres:gpumem:5")][..],
            "has gpumem other than per node",
        ),
    ] {
        let mut envs = envs.to_vec();
        envs.extend([("SLURM_JOB_ID", "7"), ("SLURM_STEP_ID", "0")]);
        assert_refused(&prolog, &envs, reason);
    }
}

/// Asserts that the TaskProlog `prolog` run with `envs` stops the task (exit 1) with one
/// "print" line naming `reason`, the only line the user sees: no export reaches the task.
fn assert_refused(prolog: &Path, envs: &[(&str, &str)], reason: &str) {
    let out = sh(prolog, &[], envs);
    assert_eq!(out.status.code(), Some(1), "{envs:?}: {}", stdout(&out));
    let printed = stdout(&out);
    assert!(
        printed.starts_with("print cudabudget TaskProlog: "),
        "{printed}"
    );
    assert_eq!(printed.lines().count(), 1, "{printed}");
    assert!(printed.contains(reason), "{envs:?}: {printed}");
}

#[test]
fn the_taskprolog_turns_shards_into_a_budget_and_keeps_the_jobs_own() {
    let dir = install_dir("taskprolog", true);
    let prolog = taskprolog(&dir);
    let preload = format!("export LD_PRELOAD={}/libcudabudget.so", dir.display());

    let out = sh(&prolog, &[], &[("SLURM_SHARDS_ON_NODE", "4")]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        format!("export CUDABUDGET_LIMIT=32Gi\n{preload}\n")
    );

    // The allocation is the budget: the job's own per-device budget goes.
    let out = sh(
        &prolog,
        &[],
        &[
            ("SLURM_SHARDS_ON_NODE", "2"),
            ("CUDABUDGET_LIMIT_1", "100Gi"),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        format!("unset CUDABUDGET_LIMIT_1\nexport CUDABUDGET_LIMIT=16Gi\n{preload}\n")
    );

    // The job's own budget is kept; what it preloads already comes after the library.
    let libm = "/lib/x86_64-linux-gnu/libm.so.6";
    let mut envs = vec![("CUDABUDGET_LIMIT", "20Gi")];
    if Path::new(libm).is_file() {
        envs.push(("LD_PRELOAD", libm));
    }
    let out = sh(&prolog, &[], &envs);
    assert!(out.status.success(), "{}", stderr(&out));
    let expected = match envs.get(1) {
        Some(_) => format!("{preload}:{libm}\n"),
        None => format!("{preload}\n"),
    };
    assert_eq!(stdout(&out), expected);

    // HAMi's variable is the job's own budget too.
    let out = sh(&prolog, &[], &[("CUDA_DEVICE_MEMORY_LIMIT_0", "8192m")]);
    assert_eq!(stdout(&out), format!("{preload}\n"), "{}", stderr(&out));

    // Nothing asked for: the task is left alone.
    let out = sh(&prolog, &[], &[("CUDA_VISIBLE_DEVICES", "0")]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "");
}

#[test]
fn the_taskprolog_stops_a_task_whose_budget_cannot_be_enforced() {
    let dir = install_dir("taskprolog-refusals", true);
    let prolog = taskprolog(&dir);
    let refused = |envs: &[(&str, &str)], reason: &str| assert_refused(&prolog, envs, reason);
    refused(&[("CUDABUDGET_LIMIT", "10XB")], "is not a valid budget");
    refused(&[("CUDA_DEVICE_MEMORY_LIMIT", "0")], "no budget given");
    refused(
        &[("SLURM_SHARDS_ON_NODE", "x")],
        "is not a number of shards",
    );
    refused(
        &[("SLURM_SHARDS_ON_NODE", "2"), ("CUDABUDGET_LOG", "loud")],
        "CUDABUDGET_LOG",
    );

    std::fs::remove_file(dir.join("libcudabudget.so")).unwrap();
    refused(&[("SLURM_SHARDS_ON_NODE", "2")], "is missing");
    std::fs::write(dir.join("libcudabudget.so"), b"not an ELF file").unwrap();
    refused(&[("CUDABUDGET_LIMIT", "8Gi")], "cannot be preloaded");
}

#[test]
fn the_device_plugin_pod_asks_for_units_and_mounts_nothing_of_the_node_and_the_quota_caps_them() {
    let pod = manifest("kubernetes/device-plugin-pod.yaml");
    let spec = pod_spec(&pod);
    assert!(
        list(&spec["volumes"]).is_empty(),
        "the kubelet mounts the library and the runtime directory: no hostPath"
    );
    for container in list(&spec["containers"]) {
        assert_eq!(
            container["resources"]["limits"]["cudabudget.io/memory"].as_i64(),
            Some(20)
        );
        assert_eq!(
            env_value(container, "CUDABUDGET_LIMIT"),
            None,
            "the device plugin sets the budget"
        );
    }
    let quota = manifest("kubernetes/quota.yaml");
    assert_eq!(text(&quota["kind"]), Some("ResourceQuota"));
    assert!(
        text(&quota["spec"]["hard"]["requests.cudabudget.io/memory"]).is_some(),
        "extended resources are quoted by their requests"
    );
}
