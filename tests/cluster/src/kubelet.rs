//! A real kubelet for one node of a test control plane, on containerd with runc ([`Runtime`]:
//! real containers from local images, CDI applied by containerd).
//!
//! The kubelet needs root. It changes a few host settings and paths, which [`Kubelet`] puts back
//! when it is dropped: three sysctls, `/var/lib/kubelet/device-plugins/kubelet.sock` and
//! `/var/log/containers`. It runs in a private mount namespace, so its own mounts (its root
//! directory onto itself) end with it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::api::Api;

use crate::{ControlPlane, Error, Process, free_port, io, write};

/// Sysctls the kubelet sets at start (its "kernel defaults").
const SYSCTLS: [&str; 3] = [
    "/proc/sys/vm/overcommit_memory",
    "/proc/sys/kernel/panic",
    "/proc/sys/kernel/panic_on_oops",
];

/// Host paths the kubelet creates whatever its root directory; removed if they were not there.
const HOST_PATHS: [&str; 3] = [
    "/var/lib/kubelet/device-plugins/kubelet.sock",
    "/var/lib/kubelet/device-plugins",
    "/var/log/containers",
];

/// What a container was given and did, as containerd reports it.
#[derive(Debug, Clone)]
pub struct Container {
    pub id: String,
    pub namespace: String,
    pub pod: String,
    pub pod_uid: String,
    pub container: String,
    /// The CDI device ids the kubelet passed to `CreateContainer`.
    pub cdi_devices: Vec<String>,
    pub command: Vec<String>,
    /// The process environment: the pod's, then the CDI edits'.
    pub env: Vec<String>,
    pub started: bool,
    pub exit_code: Option<i32>,
    /// The container's CRI log file.
    pub log_path: Option<PathBuf>,
}

/// The container runtime under the kubelet: containerd with runc, real containers in their own
/// namespaces, with these images (OCI tarballs, see [`crate::containerd::build_image`]) imported
/// for `imagePullPolicy: Never`. Only hostNetwork pods run. Pods of RuntimeClass `nvidia` get
/// `driver`.
pub struct Runtime {
    pub images: Vec<PathBuf>,
    pub driver: crate::containerd::Driver,
}

/// One kubelet at a time per test process: kubelets share host paths and sysctls, and each puts
/// back what it found.
static ONE_AT_A_TIME: std::sync::OnceLock<std::sync::Arc<tokio::sync::Mutex<()>>> =
    std::sync::OnceLock::new();

pub struct Kubelet {
    _turn: tokio::sync::OwnedMutexGuard<()>,
    node: String,
    dir: PathBuf,
    bin: PathBuf,
    args: Vec<String>,
    runtime: crate::containerd::Containerd,
    kubelet: Option<Process>,
    sysctls: Vec<(&'static str, String)>,
    created: Vec<&'static str>,
    /// `/var/lib/kubelet`, when the kubelet made it.
    var_lib_kubelet: bool,
    /// The kubelet's own cgroup root in every hierarchy, removed at the end.
    cgroup_root: String,
}

/// The cgroup hierarchies of this machine (`/sys/fs/cgroup/<name>`).
fn cgroup_hierarchies() -> Vec<PathBuf> {
    std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("cgroup.procs").exists())
        .collect()
}

/// Makes cgroup `name` in every hierarchy (the kubelet refuses a root missing from one), with
/// the parent's CPUs and memory nodes where cpuset needs them.
fn make_cgroup_root(name: &str) -> Result<String, Error> {
    for hierarchy in cgroup_hierarchies() {
        let dir = hierarchy.join(name);
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        for file in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(value) = std::fs::read_to_string(hierarchy.join(file)) {
                std::fs::write(dir.join(file), value.trim())
                    .map_err(io(format!("writing {}", dir.join(file).display())))?;
            }
        }
    }
    Ok(name.to_string())
}

/// Removes cgroup `name` and what the kubelet made under it, deepest first; a cgroup whose last
/// process is still exiting is busy for a moment, so this tries for a few seconds.
fn remove_cgroup_root(name: &str) {
    fn remove(dir: &Path) -> bool {
        let mut gone = true;
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if entry.path().is_dir() {
                gone &= remove(&entry.path());
            }
        }
        gone && (std::fs::remove_dir(dir).is_ok() || !dir.exists())
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cgroup_hierarchies().iter().all(|h| remove(&h.join(name))) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl ControlPlane {
    /// Starts a kubelet registering node `node` with `labels`, on containerd. `Ok(None)` (said
    /// loudly on stderr) when not root and `CI` is not set (the kubelet needs root), or when
    /// containerd is not built (which under `CI` fails).
    pub async fn start_kubelet(
        &self,
        node: &str,
        labels: &[(&str, &str)],
        runtime: Runtime,
    ) -> Result<Option<Kubelet>, Error> {
        // SAFETY: geteuid has no preconditions and touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            let why = "the kubelet needs root";
            if std::env::var_os("CI").is_none() {
                eprintln!("\n!!! SKIPPED: {why}\n");
                return Ok(None);
            }
            return Err(Error::Missing(why.into()));
        }
        let turn = ONE_AT_A_TIME
            .get_or_init(Default::default)
            .clone()
            .lock_owned()
            .await;
        let dir = self.dir.path().join(format!("kubelet-{node}"));
        for sub in [
            "root/plugins_registry",
            "root/plugins",
            "pod-logs",
            "volume-plugins",
        ] {
            std::fs::create_dir_all(dir.join(sub)).map_err(io(format!("creating {sub}")))?;
        }
        // The kubelet runs in containerd's mount namespace, whose runc must see the kubelet's
        // mounts for pods.
        let Some(containerd) =
            crate::containerd::Containerd::start(&dir.join("containerd"), &runtime.driver)?
        else {
            return Ok(None);
        };
        for image in &runtime.images {
            containerd.import(image)?;
        }
        let socket = containerd.socket();
        // Its pid namespace too: that mount namespace's /proc is the pid namespace's.
        let namespace = vec![
            format!("--mount={}", containerd.namespace("mnt").display()),
            format!("--pid={}", containerd.namespace("pid").display()),
        ];
        // The kubelet lays out pod cgroups as on a real node
        // (`<root>/kubepods/<qos>/pod<uid>/<container>`), under a root of its own: the agent finds
        // a process's pod from that path. One per kubelet ever started: a root left busy by the
        // last is never reused.
        static STARTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let cgroup_root = make_cgroup_root(&format!(
            "gpuslice-kubelet-{node}-{}-{n}",
            std::process::id()
        ))?;
        let (port, healthz) = (free_port()?, free_port()?);
        let config = serde_json::json!({
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            // These machines are cgroup v1 without systemd managing the tree.
            "failCgroupV1": false,
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": true,
            "cgroupRoot": format!("/{cgroup_root}"),
            "enforceNodeAllocatable": [],
            "failSwapOn": false,
            "containerRuntimeEndpoint": format!("unix://{}", socket.display()),
            "imageServiceEndpoint": format!("unix://{}", socket.display()),
            "authentication": {"anonymous": {"enabled": true}, "webhook": {"enabled": false}},
            "authorization": {"mode": "AlwaysAllow"},
            "staticPodPath": "",
            "podLogsDir": dir.join("pod-logs"),
            "volumePluginDir": dir.join("volume-plugins"),
            "address": "127.0.0.1",
            "port": port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": healthz,
            // Quick retries of what failed (a plugin not registered yet).
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
            "nodeStatusUpdateFrequency": "2s",
            // The host's disk is shared with builds and other tests: kubelet's default thresholds
            // (imagefs 15 % free) would evict or refuse pods whenever a build fills it, and image
            // garbage collection would delete images that were imported, not pulled.
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
                "imagefs.inodesFree": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
        });
        let config_path = dir.join("kubelet.yaml");
        write(
            &config_path,
            &serde_yaml::to_string(&config).map_err(|e| Error::Kubeconfig(e.to_string()))?,
        )?;
        let node_labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let mut args = namespace;
        args.extend([
            self.bin.join("kubelet").display().to_string(),
            format!("--config={}", config_path.display()),
            format!("--kubeconfig={}", self.kubeconfig_path().display()),
            format!("--root-dir={}", dir.join("root").display()),
            format!("--cert-dir={}", dir.join("pki").display()),
            format!("--hostname-override={node}"),
            format!("--node-labels={}", node_labels.join(",")),
            "--v=2".to_string(),
        ]);
        let sysctls = SYSCTLS
            .iter()
            .filter_map(|p| Some((*p, std::fs::read_to_string(p).ok()?)))
            .collect();
        let created = HOST_PATHS
            .iter()
            .copied()
            .filter(|p| !Path::new(p).exists())
            .collect();
        let mut kubelet = Kubelet {
            _turn: turn,
            node: node.to_string(),
            bin: PathBuf::from("nsenter"),
            args,
            runtime: containerd,
            kubelet: None,
            sysctls,
            created,
            var_lib_kubelet: !Path::new("/var/lib/kubelet").exists(),
            cgroup_root,
            dir,
        };
        kubelet.start(self).await?;
        Ok(Some(kubelet))
    }
}

impl Kubelet {
    /// The kubelet's `--root-dir` (its `plugins_registry/` and `plugins/` are the agent's
    /// `--kubelet-dir`).
    pub fn root_dir(&self) -> PathBuf {
        self.dir.join("root")
    }

    /// Where the runtime looks for CDI specs (the agent's `--cdi-dir`).
    pub fn cdi_dir(&self) -> PathBuf {
        self.runtime.cdi_dir()
    }

    /// Every container the runtime was asked to create.
    pub fn containers(&self) -> Vec<Container> {
        self.runtime.containers()
    }

    /// What a container's process printed.
    pub fn output(&self, container: &Container) -> String {
        container
            .log_path
            .as_deref()
            .map(crate::containerd::output)
            .unwrap_or_default()
    }

    /// Stops the kubelet (not the runtime: the containers go on) and starts it again; returns
    /// when its node is Ready again.
    pub async fn restart(&mut self, cluster: &ControlPlane) -> Result<(), Error> {
        if let Some(mut k) = self.kubelet.take() {
            k.stop_with_children();
        }
        self.start(cluster).await
    }

    async fn start(&mut self, cluster: &ControlPlane) -> Result<(), Error> {
        let mut process = Process::spawn("kubelet", &self.bin, &self.args, &self.dir)?;
        let nodes: Api<Node> = Api::all(cluster.client().await?);
        let started = std::time::SystemTime::now();
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            process.check_alive()?;
            let ready = nodes.get_opt(&self.node).await?.and_then(|n| {
                n.status?.conditions?.into_iter().find(|c| {
                    c.type_ == "Ready"
                        && c.status == "True"
                        && c.last_heartbeat_time
                            .as_ref()
                            .is_some_and(|t| std::time::SystemTime::from(t.0) >= started)
                })
            });
            if ready.is_some() {
                break;
            }
            if Instant::now() > deadline {
                return Err(Error::NotReady {
                    component: format!("kubelet of {}", self.node),
                    seconds: 90,
                    log: process.log_text(),
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        self.kubelet = Some(process);
        Ok(())
    }

    /// The last lines of the kubelet's and the runtime's logs.
    pub fn logs(&self) -> String {
        let kubelet = self
            .kubelet
            .as_ref()
            .map(|k| k.log_text())
            .unwrap_or_default();
        format!(
            "----- kubelet of {} -----\n{kubelet}\n----- containerd -----\n{}\n",
            self.node,
            self.runtime.log_text()
        )
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        if let Some(mut k) = self.kubelet.take() {
            k.stop_with_children();
        }
        // Its containers end with it; then their cgroups can go.
        self.runtime.stop();
        remove_cgroup_root(&self.cgroup_root);
        for (path, value) in &self.sysctls {
            let _ = std::fs::write(path, value);
        }
        for path in &self.created {
            let _ = std::fs::remove_file(path).or_else(|_| std::fs::remove_dir_all(path));
        }
        if self.var_lib_kubelet {
            let _ = std::fs::remove_dir("/var/lib/kubelet");
        }
    }
}
