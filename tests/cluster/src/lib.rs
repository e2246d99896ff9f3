//! A private Kubernetes control plane for tests: etcd, kube-apiserver (with generated serving
//! certificates and a service-account key), and optionally kube-controller-manager,
//! kube-scheduler and kwok (fake kubelets), all on loopback ports chosen at start, in a temporary
//! directory that goes away when the [`ControlPlane`] drops — also when a test panics, in which
//! case each component's log is printed first.
//!
//! The binaries are built from the Go module proxy by `tests/controlplane/build.sh`. When they
//! are absent, [`ControlPlane::start`] returns `Ok(None)` after a loud message, except when the
//! `CI` environment variable is set: then their absence is an error.
//!
//! One control plane per test: etcd and the API server are ready in a few seconds, and a test
//! that owns its control plane can restart it, break it and read its logs without disturbing others.

pub mod containerd;
pub mod demo;
mod kubelet;
pub mod scale;

pub use kubelet::{Container, Kubelet, Runtime};

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Node, Pod, ServiceAccount};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// Why the control plane could not be started or used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("control-plane binaries not found: {0}")]
    Missing(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("generating certificates: {0}")]
    Certificates(#[from] rcgen::Error),
    #[error("{component} did not become ready within {seconds} s; its log:\n{log}")]
    NotReady {
        component: String,
        seconds: u64,
        log: String,
    },
    #[error("{component} exited early ({status}); its log:\n{log}")]
    Exited {
        component: String,
        status: String,
        log: String,
    },
    #[error("kubernetes client: {0}")]
    Kube(#[from] kube::Error),
    #[error("kubeconfig: {0}")]
    Kubeconfig(String),
    #[error("CRD {name}: {message}")]
    Crd { name: String, message: String },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// Which components to run besides etcd and the API server.
#[derive(Clone, Copy, Debug, Default)]
pub struct Components {
    /// kube-controller-manager: node lifecycle (removes the not-ready taint), service accounts, jobs…
    pub controller_manager: bool,
    pub scheduler: bool,
    /// kwok, managing nodes made with [`ControlPlane::create_node`].
    pub kwok: bool,
    /// The request rate the scheduler and the controller-manager allow themselves (QPS; burst
    /// twice that), as large clusters raise it; their defaults (50 and 20) when `None`.
    pub api_qps: Option<u32>,
}

impl Components {
    /// Everything: what a pod needs to be scheduled and run on a fake node.
    pub fn all() -> Self {
        Components {
            controller_manager: true,
            scheduler: true,
            kwok: true,
            api_qps: None,
        }
    }
}

/// Where the built binaries and kwok's stages are, or why not.
pub fn locate_binaries() -> Result<PathBuf, Error> {
    if let Some(dir) = std::env::var_os("GPUSLICE_CONTROLPLANE_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../controlplane/build.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg("--find")
        .output()
        .map_err(io(format!("running {}", script.display())))?;
    if out.status.success() {
        Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    } else {
        Err(Error::Missing(format!(
            "run `bash tests/controlplane/build.sh` once (about 8 minutes cold) or set GPUSLICE_CONTROLPLANE_DIR; {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// The namespace and release name the e2e tests give the chart's identities.
pub const CHART_NAMESPACE: &str = "gpuslice-system";
pub const CHART_RELEASE: &str = "gs";

/// A tool that one of `tests/<dir>/build.sh` builds and caches: `name` in the folder (or the file,
/// when `name` is empty) that `env` names or the build script prints. `None` (the test skips) when it is not built; under CI that is a
/// failure, so that a missing tool never passes silently.
pub fn built_tool(env: &str, dir: &str, name: &str) -> Option<PathBuf> {
    let found = find_built_tool(env, dir, name);
    if found.is_none() {
        let hint = format!("run `bash tests/{dir}/build.sh` once or set {env}");
        assert!(std::env::var_os("CI").is_none(), "{env} unset: {hint}");
        eprintln!("SKIPPED: {env} unset ({hint})");
    }
    found
}

/// Like [`built_tool`], silently: `None` when it is not built.
pub fn find_built_tool(env: &str, dir: &str, name: &str) -> Option<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../{dir}/build.sh"));
    let found = std::env::var_os(env).map(PathBuf::from).or_else(|| {
        Command::new("bash")
            .arg(&script)
            .arg("--find")
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    })?;
    Some(if name.is_empty() {
        found
    } else {
        found.join(name)
    })
}

/// Commits everything in the work tree of `repo` on top of HEAD (if any) and moves HEAD there
/// (what a merged pull request pushes); returns the commit id.
pub fn commit_all(repo: &git2::Repository, message: &str) -> String {
    let mut index = repo.index().unwrap();
    index
        .add_all(["*"], git2::IndexAddOption::DEFAULT, None)
        .unwrap();
    index.write().unwrap();
    let tree = repo.find_tree(index.write_tree().unwrap()).unwrap();
    let sig = git2::Signature::now("platform team", "platform@example.com").unwrap();
    let parent = repo.head().ok().map(|h| h.peel_to_commit().unwrap());
    repo.commit(
        Some("HEAD"),
        &sig,
        &sig,
        message,
        &tree,
        &parent.iter().collect::<Vec<_>>(),
    )
    .unwrap()
    .to_string()
}

/// The folder of Alibaba trace CSVs (`GPUSLICE_TRACE_DATA`, else the workspace's
/// `../shared/data/alibaba-gpu-v2023`) when it holds `file`. Without it a test is skipped, except
/// in CI, where `.ci/run` finds the data and its absence fails the test.
pub fn trace_data(file: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("GPUSLICE_TRACE_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/alibaba-gpu-v2023")
        });
    if dir.join(file).exists() {
        return Some(dir);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "the trace data is missing; set GPUSLICE_TRACE_DATA"
    );
    eprintln!("SKIPPED: no trace data (set GPUSLICE_TRACE_DATA to cluster-trace-gpu-v2023/csv)");
    None
}

/// Copies a folder tree (a test's own copy of the examples).
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

struct Process {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Process {
    fn spawn(
        name: &'static str,
        bin: &Path,
        args: &[String],
        dir: &Path,
    ) -> Result<Process, Error> {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(io(format!("opening {}", log.display())))?;
        let err = file.try_clone().map_err(io("duplicating a log file"))?;
        let mut command = Command::new(bin);
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err);
        kill_with_parent(&mut command);
        let child = command
            .spawn()
            .map_err(io(format!("starting {}", bin.display())))?;
        Ok(Process { name, child, log })
    }

    fn log_text(&self) -> String {
        tail(&self.log, 60)
    }

    fn check_alive(&mut self) -> Result<(), Error> {
        match self.child.try_wait() {
            Ok(Some(status)) => Err(Error::Exited {
                component: self.name.to_string(),
                status: status.to_string(),
                log: self.log_text(),
            }),
            _ => Ok(()),
        }
    }

    /// Stops a launcher (`nsenter`) and the process it forked, which outlives it otherwise.
    fn stop_with_children(&mut self) {
        for child in children(self.child.id()) {
            // SAFETY: sending a signal to a process; no memory is touched.
            unsafe {
                libc::kill(child as i32, libc::SIGKILL);
            }
        }
        self.stop();
    }

    fn stop(&mut self) {
        // SIGTERM first so etcd and the API server shut down cleanly; SIGKILL if they linger.
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: sending a signal to our own child process; no memory is touched.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The direct children of a process (none when it is gone).
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Children die with the test process even when it is killed, so no component outlives a run.
fn kill_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A local TCP port free a moment ago (for a process to listen on).
pub fn free_port() -> Result<u16, Error> {
    use std::sync::atomic::{AtomicU32, Ordering};
    // Below the kernel's ephemeral range (32768–60999 by default): a port the kernel handed out
    // for a moment can be taken as the source port of some outgoing connection before the
    // component binds it, which fails the component with "address already in use".
    const FIRST: u32 = 20000;
    const COUNT: u32 = 12000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let offset = std::process::id().wrapping_mul(7919) % COUNT;
    for _ in 0..COUNT {
        let port = FIRST + (offset + NEXT.fetch_add(1, Ordering::Relaxed)) % COUNT;
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port as u16)).is_ok() {
            return Ok(port as u16);
        }
    }
    let listener =
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(io("choosing a free port"))?;
    Ok(listener
        .local_addr()
        .map_err(io("choosing a free port"))?
        .port())
}

/// The certificates and keys of one control plane, as files in its directory.
struct Pki;

fn write(path: &Path, text: &str) -> Result<(), Error> {
    std::fs::write(path, text).map_err(io(format!("writing {}", path.display())))
}

impl Pki {
    /// A CA, the API server's serving certificate, an admin client certificate
    /// (`system:masters`) and the service-account signing key, written into `dir`.
    fn generate(dir: &Path) -> Result<(), Error> {
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "gpuslice-test-ca");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let issuer = Issuer::from_params(&ca_params, &ca_key);

        let serving_key = KeyPair::generate()?;
        let mut serving = CertificateParams::new(vec![
            "localhost".to_string(),
            "kubernetes.default.svc".to_string(),
        ])?;
        serving
            .subject_alt_names
            .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        serving
            .subject_alt_names
            .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 1))));
        serving
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_cert = serving.signed_by(&serving_key, &issuer)?;

        let admin_key = KeyPair::generate()?;
        let mut admin = CertificateParams::new(Vec::<String>::new())?;
        admin
            .distinguished_name
            .push(DnType::CommonName, "gpuslice-test-admin");
        admin
            .distinguished_name
            .push(DnType::OrganizationName, "system:masters");
        admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let admin_cert = admin.signed_by(&admin_key, &issuer)?;

        let sa_key = KeyPair::generate()?;
        write(&dir.join("ca.crt"), &ca_cert.pem())?;
        write(&dir.join("apiserver.crt"), &serving_cert.pem())?;
        write(&dir.join("apiserver.key"), &serving_key.serialize_pem())?;
        write(&dir.join("admin.crt"), &admin_cert.pem())?;
        write(&dir.join("admin.key"), &admin_key.serialize_pem())?;
        write(&dir.join("sa.key"), &sa_key.serialize_pem())?;
        write(&dir.join("sa.pub"), &sa_key.public_key_pem())?;
        Ok(())
    }
}

/// A running control plane. Dropping it stops every component and deletes its directory.
pub struct ControlPlane {
    dir: tempfile::TempDir,
    bin: PathBuf,
    stages: PathBuf,
    server: String,
    apiserver_args: Vec<String>,
    processes: Vec<Process>,
}

const READY_TIMEOUT: Duration = Duration::from_secs(90);

impl ControlPlane {
    /// Starts a control plane, or returns `Ok(None)` (after saying so loudly on stderr) when the
    /// binaries have not been built and `CI` is not set.
    pub async fn start(components: Components) -> Result<Option<ControlPlane>, Error> {
        let binaries = match locate_binaries() {
            Ok(dir) => dir,
            Err(e) if std::env::var_os("CI").is_none() => {
                eprintln!("\n!!! SKIPPED: no Kubernetes control plane for this test: {e}\n");
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let dir = tempfile::Builder::new()
            .prefix("gpuslice-cp-")
            .tempdir()
            .map_err(io("creating a temporary directory"))?;
        Pki::generate(dir.path())?;
        let (etcd_port, peer_port, api_port) = (free_port()?, free_port()?, free_port()?);
        let server = format!("https://127.0.0.1:{api_port}");
        let mut cp = ControlPlane {
            bin: binaries.join("bin"),
            stages: binaries.join("stages/stages.yaml"),
            server,
            apiserver_args: Vec::new(),
            processes: Vec::new(),
            dir,
        };
        let d = cp.dir.path().to_path_buf();
        let p = |name: &str| d.join(name).display().to_string();
        cp.write_kubeconfig(&d.join("admin.kubeconfig"), None)?;

        let etcd_args = vec![
            "--name=default".to_string(),
            format!("--data-dir={}", p("etcd")),
            format!("--listen-client-urls=http://127.0.0.1:{etcd_port}"),
            format!("--advertise-client-urls=http://127.0.0.1:{etcd_port}"),
            format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"),
            format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}"),
            format!("--initial-cluster=default=http://127.0.0.1:{peer_port}"),
            "--unsafe-no-fsync=true".to_string(),
            "--log-level=warn".to_string(),
        ];
        cp.spawn("etcd", "etcd", &etcd_args)?;
        cp.wait_for_port("etcd", etcd_port).await?;

        cp.apiserver_args = vec![
            format!("--etcd-servers=http://127.0.0.1:{etcd_port}"),
            "--bind-address=127.0.0.1".to_string(),
            "--advertise-address=127.0.0.1".to_string(),
            format!("--secure-port={api_port}"),
            format!("--tls-cert-file={}", p("apiserver.crt")),
            format!("--tls-private-key-file={}", p("apiserver.key")),
            format!("--client-ca-file={}", p("ca.crt")),
            "--authorization-mode=RBAC".to_string(),
            "--service-account-issuer=https://kubernetes.default.svc".to_string(),
            format!("--service-account-key-file={}", p("sa.pub")),
            format!("--service-account-signing-key-file={}", p("sa.key")),
            "--service-cluster-ip-range=10.96.0.0/16".to_string(),
            "--allow-privileged=true".to_string(),
            format!("--cert-dir={}", p("apiserver-certs")),
        ];
        cp.start_apiserver().await?;

        let kubeconfig = p("admin.kubeconfig");
        if components.controller_manager {
            let mut args = component_args(&kubeconfig, &p("kcm-certs"))?;
            args.extend([
                format!("--service-account-private-key-file={}", p("sa.key")),
                format!("--root-ca-file={}", p("ca.crt")),
                "--use-service-account-credentials=false".to_string(),
                // Fake nodes have no routes or cloud; everything else runs.
                "--controllers=*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-node-route-controller".to_string(),
                "--node-monitor-grace-period=60s".to_string(),
            ]);
            args.extend(rate_args(components.api_qps));
            cp.spawn("kube-controller-manager", "kube-controller-manager", &args)?;
        }
        if components.scheduler {
            let mut args = component_args(&kubeconfig, &p("scheduler-certs"))?;
            args.extend(rate_args(components.api_qps));
            cp.spawn("kube-scheduler", "kube-scheduler", &args)?;
        }
        if components.kwok {
            let args = vec![
                format!("--kubeconfig={kubeconfig}"),
                format!("--config={}", cp.stages.display()),
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake".to_string(),
                "--node-ip=10.0.0.1".to_string(),
                // Renew each node's Lease (every 10 s): without it the node lifecycle controller
                // finds the fake nodes silent after its grace period, marks them and their pods
                // not Ready, and kwok never makes those pods Ready again.
                "--node-lease-duration-seconds=40".to_string(),
                "--cidr=10.0.0.0/16".to_string(),
                format!("--server-address=127.0.0.1:{}", free_port()?),
            ];
            cp.spawn("kwok", "kwok", &args)?;
        }
        // Give the extra components a moment to fail on bad flags, so it shows here.
        tokio::time::sleep(Duration::from_millis(300)).await;
        for proc in &mut cp.processes {
            proc.check_alive()?;
        }
        Ok(Some(cp))
    }

    fn spawn(&mut self, name: &'static str, bin: &str, args: &[String]) -> Result<(), Error> {
        let proc = Process::spawn(name, &self.bin.join(bin), args, self.dir.path())?;
        self.processes.push(proc);
        Ok(())
    }

    fn process(&mut self, name: &str) -> Option<&mut Process> {
        self.processes.iter_mut().find(|p| p.name == name)
    }

    async fn wait_for_port(&mut self, name: &str, port: u16) -> Result<(), Error> {
        let start = Instant::now();
        loop {
            if TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok() {
                return Ok(());
            }
            if let Some(p) = self.process(name) {
                p.check_alive()?;
            }
            if start.elapsed() > READY_TIMEOUT {
                let log = self.process(name).map(|p| p.log_text()).unwrap_or_default();
                return Err(Error::NotReady {
                    component: name.to_string(),
                    seconds: READY_TIMEOUT.as_secs(),
                    log,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn start_apiserver(&mut self) -> Result<(), Error> {
        let args = self.apiserver_args.clone();
        self.spawn("kube-apiserver", "kube-apiserver", &args)?;
        let client = self.client().await?;
        let start = Instant::now();
        loop {
            let request = http_get("/readyz");
            if let Ok(text) = client.request_text(request).await
                && text.trim() == "ok"
            {
                return Ok(());
            }
            if let Some(p) = self.process("kube-apiserver") {
                p.check_alive()?;
            }
            if start.elapsed() > READY_TIMEOUT {
                let log = self
                    .process("kube-apiserver")
                    .map(|p| p.log_text())
                    .unwrap_or_default();
                return Err(Error::NotReady {
                    component: "kube-apiserver".into(),
                    seconds: READY_TIMEOUT.as_secs(),
                    log,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the API server and starts it again on the same port and etcd, as an upgrade or a
    /// crash would. Returns when it is ready again.
    pub async fn restart_apiserver(&mut self) -> Result<(), Error> {
        if let Some(i) = self
            .processes
            .iter()
            .position(|p| p.name == "kube-apiserver")
        {
            let mut old = self.processes.remove(i);
            old.stop();
        }
        self.start_apiserver().await
    }

    /// The API server's URL.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The admin kubeconfig (client certificate in `system:masters`).
    pub fn kubeconfig_path(&self) -> PathBuf {
        self.dir.path().join("admin.kubeconfig")
    }

    /// Runs the control plane's own kubectl (the API server's version, so no skew) as admin and
    /// returns what it printed; panics with its error output when it fails.
    pub fn kubectl(&self, args: &[&str]) -> String {
        let out = Command::new(self.bin.join("kubectl"))
            .arg("--kubeconfig")
            .arg(self.kubeconfig_path())
            .args(args)
            .output()
            .expect("kubectl runs");
        assert!(
            out.status.success(),
            "kubectl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The directory with the components' logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn write_kubeconfig(&self, path: &Path, token: Option<&str>) -> Result<(), Error> {
        let d = self.dir.path();
        let user = match token {
            Some(t) => serde_json::json!({"token": t}),
            None => serde_json::json!({
                "client-certificate": d.join("admin.crt"),
                "client-key": d.join("admin.key"),
            }),
        };
        let config = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "gpuslice-test", "cluster": {"server": self.server, "certificate-authority": d.join("ca.crt")}}],
            "users": [{"name": "user", "user": user}],
            "contexts": [{"name": "gpuslice-test", "context": {"cluster": "gpuslice-test", "user": "user"}}],
            "current-context": "gpuslice-test",
        });
        let text = serde_yaml::to_string(&config).map_err(|e| Error::Kubeconfig(e.to_string()))?;
        let mut f =
            std::fs::File::create(path).map_err(io(format!("writing {}", path.display())))?;
        f.write_all(text.as_bytes())
            .map_err(io(format!("writing {}", path.display())))
    }

    async fn client_from(path: &Path) -> Result<Client, Error> {
        let kubeconfig =
            Kubeconfig::read_from(path).map_err(|e| Error::Kubeconfig(e.to_string()))?;
        let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(|e| Error::Kubeconfig(e.to_string()))?;
        Ok(Client::try_from(config)?)
    }

    /// A client with admin rights.
    pub async fn client(&self) -> Result<Client, Error> {
        Self::client_from(&self.kubeconfig_path()).await
    }

    /// A client with admin rights, our CRDs (the repository's `crds`) installed first; panics
    /// where either fails.
    pub async fn client_with_crds(&self) -> Client {
        let client = self.client().await.unwrap();
        install_crds(&client, &repo_root().join("crds"))
            .await
            .unwrap();
        client
    }

    /// A client that authenticates as a ServiceAccount (created if missing), with exactly the
    /// rights RBAC gives it.
    pub async fn service_account_client(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Client, Error> {
        self.token_client(namespace, name, None).await
    }

    /// Applies the identities the chart gives gpuslice, as `helm install` would: its
    /// ServiceAccounts, roles and bindings, the policies that keep each agent to its own node's
    /// objects, and the (empty) ConfigMap of admission parameters the operator fills, rendered by helm from `charts/gpuslice` (release [`CHART_RELEASE`] in
    /// [`CHART_NAMESPACE`]). End-to-end tests run the operator and the agents as these
    /// ([`operator_kubeconfig`](Self::operator_kubeconfig),
    /// [`agent_kubeconfig`](Self::agent_kubeconfig)), never as admin, so a verb the chart's roles
    /// lack fails them. `false` (the test skips) when helm is not built; under CI that fails.
    pub async fn install_chart_identities(&self) -> Result<bool, Error> {
        let Some(helm) = built_tool("GPUSLICE_HELM", "helm", "") else {
            return Ok(false);
        };
        let chart = repo_root().join("charts/gpuslice");
        let out = Command::new(&helm)
            .args(["template", CHART_RELEASE, "--namespace", CHART_NAMESPACE])
            .arg(&chart)
            .output()
            .map_err(io(format!("running {}", helm.display())))?;
        if !out.status.success() {
            return Err(Error::Kubeconfig(format!(
                "helm template: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let identity = |doc: &serde_json::Value| {
            let kind = doc["kind"].as_str().unwrap_or_default();
            let name = doc["metadata"]["name"].as_str().unwrap_or_default();
            matches!(
                kind,
                "ServiceAccount" | "ClusterRole" | "ClusterRoleBinding" | "Role" | "RoleBinding"
            ) || (kind.starts_with("ValidatingAdmissionPolicy")
                && name.starts_with(&format!("{CHART_RELEASE}-agent-")))
                || (kind == "ConfigMap" && name == format!("{CHART_RELEASE}-policies"))
        };
        let docs: Vec<serde_json::Value> = documents(&String::from_utf8_lossy(&out.stdout))
            .into_iter()
            .filter(identity)
            .collect();
        let admin = self.client().await?;
        ensure_namespace(&admin, CHART_NAMESPACE).await?;
        apply_all(&admin, &docs).await;
        Ok(true)
    }

    /// A kubeconfig for the chart's operator ServiceAccount (after
    /// [`install_chart_identities`](Self::install_chart_identities)).
    pub async fn operator_kubeconfig(&self) -> Result<PathBuf, Error> {
        let name = format!("{CHART_RELEASE}-operator");
        self.token_client(CHART_NAMESPACE, &name, None).await?;
        Ok(self.token_kubeconfig_path(CHART_NAMESPACE, &name, None))
    }

    /// A kubeconfig for the chart's agent ServiceAccount with a token bound to its pod on
    /// `node`, as the DaemonSet's pod there has (after
    /// [`install_chart_identities`](Self::install_chart_identities)).
    pub async fn agent_kubeconfig(&self, node: &str) -> Result<PathBuf, Error> {
        let name = format!("{CHART_RELEASE}-agent");
        self.pod_service_account_client(CHART_NAMESPACE, &name, node)
            .await?;
        Ok(self.token_kubeconfig_path(CHART_NAMESPACE, &name, Some(node)))
    }

    fn token_kubeconfig_path(&self, namespace: &str, name: &str, node: Option<&str>) -> PathBuf {
        let node = node.map(|n| format!("-on-{n}")).unwrap_or_default();
        self.dir
            .path()
            .join(format!("sa-{namespace}-{name}{node}.kubeconfig"))
    }

    /// Like [`service_account_client`](Self::service_account_client), with a token bound to a pod
    /// of that ServiceAccount on `node` (created if missing, never run), as a DaemonSet's pod
    /// has: the API server then names the node in the token's user info.
    pub async fn pod_service_account_client(
        &self,
        namespace: &str,
        name: &str,
        node: &str,
    ) -> Result<Client, Error> {
        let pods: Api<Pod> = Api::namespaced(self.client().await?, namespace);
        let pod_name = format!("{name}-{node}");
        let pod = match pods.get_opt(&pod_name).await? {
            Some(pod) => pod,
            None => {
                let pod: Pod = serde_json::from_value(serde_json::json!({
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": pod_name},
                    "spec": {
                        "serviceAccountName": name,
                        "nodeName": node,
                        "containers": [{"name": "main", "image": "example.com/agent:1"}]
                    }
                }))
                .map_err(|e| Error::Kubeconfig(e.to_string()))?;
                pods.create(&PostParams::default(), &pod).await?
            }
        };
        let bound = k8s_openapi::api::authentication::v1::BoundObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: pod.metadata.name.clone(),
            uid: pod.metadata.uid.clone(),
        };
        self.token_client(namespace, name, Some((bound, node)))
            .await
    }

    async fn token_client(
        &self,
        namespace: &str,
        name: &str,
        bound: Option<(
            k8s_openapi::api::authentication::v1::BoundObjectReference,
            &str,
        )>,
    ) -> Result<Client, Error> {
        let path = self.token_kubeconfig_path(namespace, name, bound.as_ref().map(|b| b.1));
        let bound = bound.map(|b| b.0);
        let admin = self.client().await?;
        let accounts: Api<ServiceAccount> = Api::namespaced(admin, namespace);
        if accounts.get_opt(name).await?.is_none() {
            let sa = ServiceAccount {
                metadata: ObjectMeta {
                    name: Some(name.to_string()),
                    ..Default::default()
                },
                ..Default::default()
            };
            accounts.create(&PostParams::default(), &sa).await?;
        }
        let request = TokenRequest {
            spec: Some(k8s_openapi::api::authentication::v1::TokenRequestSpec {
                audiences: Some(vec!["https://kubernetes.default.svc".to_string()]),
                expiration_seconds: Some(3600),
                bound_object_ref: bound,
            }),
            ..Default::default()
        };
        let token = accounts
            .create_token_request(name, &PostParams::default(), &request)
            .await?;
        let token = token.status.and_then(|s| s.token).unwrap_or_default();
        self.write_kubeconfig(&path, Some(&token))?;
        Self::client_from(&path).await
    }

    /// Creates a fake node that kwok keeps Ready, with labels and capacity (extended resources
    /// included, e.g. `nvidia.com/gpu`). Capacity is also its allocatable.
    pub async fn create_node(
        &self,
        name: &str,
        labels: &[(&str, &str)],
        capacity: &[(&str, &str)],
    ) -> Result<Node, Error> {
        let mut all_labels: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        all_labels.insert("type".into(), "kwok".into());
        all_labels.insert("kubernetes.io/hostname".into(), name.into());
        let mut resources: BTreeMap<String, Quantity> =
            [("cpu", "32"), ("memory", "256Gi"), ("pods", "110")]
                .iter()
                .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                .collect();
        resources.extend(
            capacity
                .iter()
                .map(|(k, v)| (k.to_string(), Quantity(v.to_string()))),
        );
        let node: Node = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": all_labels,
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": {},
            "status": {"capacity": resources, "allocatable": resources},
        }))
        .map_err(|e| Error::Kubeconfig(e.to_string()))?;
        let nodes: Api<Node> = Api::all(self.client().await?);
        Ok(nodes.create(&PostParams::default(), &node).await?)
    }

    /// The process id of a running component (`kube-apiserver`, `etcd`, …).
    pub fn pid(&self, component: &str) -> Option<u32> {
        self.processes
            .iter()
            .find(|p| p.name == component)
            .map(|p| p.child.id())
    }

    /// The last lines of every component's log.
    pub fn logs(&self) -> String {
        self.processes
            .iter()
            .map(|p| {
                format!(
                    "----- {} ({}) -----\n{}\n",
                    p.name,
                    p.log.display(),
                    p.log_text()
                )
            })
            .collect()
    }
}

/// Flags the controller-manager and the scheduler share: admin kubeconfig, no leader election,
/// their own serving port on loopback.
fn component_args(kubeconfig: &str, cert_dir: &str) -> Result<Vec<String>, Error> {
    Ok(vec![
        format!("--kubeconfig={kubeconfig}"),
        format!("--authentication-kubeconfig={kubeconfig}"),
        format!("--authorization-kubeconfig={kubeconfig}"),
        "--leader-elect=false".to_string(),
        "--bind-address=127.0.0.1".to_string(),
        format!("--secure-port={}", free_port()?),
        format!("--cert-dir={cert_dir}"),
    ])
}

fn rate_args(qps: Option<u32>) -> Vec<String> {
    qps.map(|q| {
        vec![
            format!("--kube-api-qps={q}"),
            format!("--kube-api-burst={}", 2 * q),
        ]
    })
    .unwrap_or_default()
}

fn http_get(path: &str) -> http::Request<Vec<u8>> {
    http::Request::get(path)
        .body(Vec::new())
        .expect("a GET request with a static path is valid")
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "\n===== control plane logs ({}) =====\n{}",
                self.dir.path().display(),
                self.logs()
            );
        }
        // Stop in reverse order: clients of the API server first, etcd last.
        while let Some(mut p) = self.processes.pop() {
            p.stop();
        }
    }
}

/// Applies every CRD in `dir` (server-side apply) and waits until each is Established.
pub async fn install_crds(client: &Client, dir: &Path) -> Result<(), Error> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::ResourceExt as _;
    use kube::api::{Patch, PatchParams};
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let io = |what: String| move |source| Error::Io { what, source };
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir.display().to_string()))? {
        let path = entry.map_err(io(dir.display().to_string()))?.path();
        let text = std::fs::read_to_string(&path).map_err(io(path.display().to_string()))?;
        let crd: CustomResourceDefinition =
            serde_yaml::from_str(&text).map_err(|e| Error::Crd {
                name: path.display().to_string(),
                message: e.to_string(),
            })?;
        let name = crd.name_any();
        crds.patch(
            &name,
            &PatchParams::apply("gpuslice-test").force(),
            &Patch::Apply(&crd),
        )
        .await?;
        names.push(name);
    }
    for name in names {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let crd = crds.get(&name).await?;
            let conditions = crd.status.and_then(|s| s.conditions).unwrap_or_default();
            let is = |t: &str| {
                conditions
                    .iter()
                    .any(|c| c.type_ == t && c.status == "True")
            };
            if is("NonStructuralSchema") {
                return Err(Error::Crd {
                    name,
                    message: format!("non-structural schema: {conditions:?}"),
                });
            }
            if is("Established") && is("NamesAccepted") {
                break;
            }
            if Instant::now() > deadline {
                return Err(Error::Crd {
                    name,
                    message: format!("not Established within 30 s: {conditions:?}"),
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

/// Creates a namespace if it does not exist.
pub async fn ensure_namespace(client: &Client, name: &str) -> Result<(), Error> {
    use kube::api::{Patch, PatchParams};
    let ns: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let object =
        serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}});
    ns.patch(
        name,
        &PatchParams::apply("gpuslice-test"),
        &Patch::Apply(&object),
    )
    .await?;
    Ok(())
}

/// The documents of a multi-document YAML text (empty ones left out).
pub fn documents(text: &str) -> Vec<serde_json::Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| serde::Deserialize::deserialize(d).expect("a YAML document"))
        .filter(|v: &serde_json::Value| !v.is_null())
        .collect()
}

/// The chart (`charts/gpuslice`) as `helm template gs --namespace NAMESPACE --set S…` renders
/// it, document by document; panics with Helm's complaint when it does not render.
pub fn render_chart(helm: &Path, namespace: &str, sets: &[&str]) -> Vec<serde_json::Value> {
    let mut command = std::process::Command::new(helm);
    command.args(["template", "gs", "--namespace", namespace]);
    for set in sets {
        command.args(["--set", set]);
    }
    let rendered = command
        .arg(repo_root().join("charts/gpuslice"))
        .output()
        .expect("helm runs");
    assert!(
        rendered.status.success(),
        "helm template: {}",
        String::from_utf8_lossy(&rendered.stderr)
    );
    documents(&String::from_utf8(rendered.stdout).expect("UTF-8 YAML"))
}

/// The examples a notebook on pool shared-a100 needs: the CheckpointPolicy, the pool, the policy.
pub const NOTEBOOK_EXAMPLES: [&str; 3] = [
    "examples/gitops/policies/checkpoint-standard.yaml",
    "examples/gitops/pools/shared-a100.yaml",
    "examples/gitops/policies/notebook.yaml",
];

/// The repository's root folder, whose examples, chart, CRDs and test programs the tests use.
pub fn repo_root() -> &'static Path {
    static ROOT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    ROOT.get_or_init(|| {
        let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        here.canonicalize().unwrap_or(here)
    })
}

/// Applies every document of each file (a path from the repository's root, or absolute) with
/// [`apply_all`].
pub async fn apply_repo_files(client: &Client, files: &[&str]) {
    let root = repo_root();
    for file in files {
        let text =
            std::fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        apply_all(client, &documents(&text)).await;
    }
}

/// Applies every document for real ([`apply_document`]); panics naming the one the server
/// refuses or does not know.
pub async fn apply_all(client: &Client, docs: &[serde_json::Value]) {
    let discovery = kube::discovery::Discovery::new(client.clone())
        .run()
        .await
        .expect("API discovery");
    for doc in docs {
        apply_document(client, &discovery, doc, false)
            .await
            .unwrap_or_else(|| panic!("no such kind: {doc}"))
            .unwrap_or_else(|e| panic!("{}: {e}", doc["metadata"]["name"]));
    }
}

/// Server-side apply of one YAML/JSON document of any kind the server knows, with strict field
/// validation, dry-run or for real; `None` when the document has no kind the server knows.
/// Namespaced objects go to their namespace (created if needed; `default` when unset).
pub async fn apply_document(
    client: &Client,
    discovery: &kube::discovery::Discovery,
    doc: &serde_json::Value,
    dry_run: bool,
) -> Option<Result<(), kube::Error>> {
    use kube::api::{DynamicObject, Patch, PatchParams};
    use kube::discovery::Scope;
    let api_version = doc["apiVersion"].as_str()?;
    let kind = doc["kind"].as_str()?;
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let gvk = kube::api::GroupVersionKind::gvk(group, version, kind);
    let (resource, caps) = discovery.resolve_gvk(&gvk)?;
    let name = doc["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let api: Api<DynamicObject> = match caps.scope {
        Scope::Cluster => Api::all_with(client.clone(), &resource),
        Scope::Namespaced => {
            let ns = doc["metadata"]["namespace"].as_str().unwrap_or("default");
            if let Err(Error::Kube(e)) = ensure_namespace(client, ns).await {
                return Some(Err(e));
            }
            Api::namespaced_with(client.clone(), ns, &resource)
        }
    };
    let mut params = PatchParams::apply("gpuslice-test").validation_strict();
    params.dry_run = dry_run;
    Some(
        api.patch(&name, &params, &Patch::Apply(doc))
            .await
            .map(|_| ()),
    )
}

/// `gpuslice agent --kube --apply` (the binary `bin`) every `interval`, emulating the node in
/// `node_file`, with its state in `state` (its pools' dataset caches in `state/caches`), its
/// kubelet plugin under `kubelet_dir` and its CDI specs in `cdi_dir`.
pub fn agent_command(
    bin: &str,
    interval: &str,
    node_file: &Path,
    state: &Path,
    kubelet_dir: &Path,
    cdi_dir: &Path,
) -> Command {
    let mut agent = Command::new(bin);
    agent
        .args([
            "agent",
            "--kube",
            "--apply",
            "--interval",
            interval,
            "--emulate",
        ])
        .arg(node_file)
        .arg("--state")
        .arg(state)
        // Pools' dataset caches, for /var/lib/gpuslice/cache.
        .arg("--cache-root")
        .arg(state.join("caches"))
        .arg("--kubelet-dir")
        .arg(kubelet_dir)
        .arg("--cdi-dir")
        .arg(cdi_dir);
    agent
}

/// The operator (`bin operator`) as the identity of `kubeconfig` (the chart's operator, in
/// these tests), its lease in the chart's namespace, with `args` and its clock starting at
/// `clock` when given; its log goes to the test's stderr.
pub fn spawn_operator(
    bin: &str,
    kubeconfig: &Path,
    clock: Option<&str>,
    args: &[&str],
) -> KillOnDrop {
    let mut operator = Command::new(bin);
    operator
        .args(["operator", "--lease-namespace", CHART_NAMESPACE])
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit());
    if let Some(clock) = clock {
        operator.env("GPUSLICE_CLOCK_START", clock);
    }
    KillOnDrop(operator.spawn().expect("the operator starts"))
}

/// Polls `check` every 200 ms until it returns `Ok`, for up to two minutes; then panics with
/// `what` and the last `Err` it gave.
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match check().await {
            Ok(v) => return v,
            Err(last) if Instant::now() > deadline => panic!("{what} did not happen; last: {last}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// The note of the first Event in namespace `default` with `reason` about the object `name`
/// (`None` while there is none).
pub async fn event_note(
    client: &Client,
    reason: &str,
    name: &str,
) -> Result<Option<String>, kube::Error> {
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), "default");
    Ok(events
        .list(&kube::api::ListParams::default())
        .await?
        .items
        .into_iter()
        .find(|e| {
            e.reason.as_deref() == Some(reason)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
        })
        .and_then(|e| e.note))
}

/// Waits until the operator has written `classes` DeviceClasses (one per policy).
pub async fn wait_for_device_classes(client: &Client, classes: usize) {
    eventually("the policies' DeviceClasses exist", || {
        let api: Api<k8s_openapi::api::resource::v1::DeviceClass> = Api::all(client.clone());
        async move {
            let n = api
                .list(&kube::api::ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .len();
            (n == classes)
                .then_some(())
                .ok_or_else(|| format!("{n} classes"))
        }
    })
    .await;
}

/// Appends to `kmsg` the NVRM line the kernel writes for XID `code` caused by `pid` on the
/// emulator's GPU 0 (PCI 0000:10:00), for an agent reading it as its `--kernel-log`.
pub fn write_kernel_xid(kmsg: &Path, code: u64, pid: u32) {
    use std::io::Write as _;
    let mut log = std::fs::OpenOptions::new().append(true).open(kmsg).unwrap();
    writeln!(
        log,
        "4,1234,5678901,-;NVRM: Xid (PCI:0000:10:00): {code}, pid={pid}, name=sh, Ch 00000008"
    )
    .unwrap();
}

/// `GET path` on a local port: (status line, body). HTTP/1.0, so that no server answers in chunks.
pub fn local_get(port: u16, path: &str) -> std::io::Result<(String, String)> {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    Ok((
        head.lines().next().unwrap_or_default().to_string(),
        body.to_string(),
    ))
}

/// A Deployment of `replicas` pods running `pod_spec`, labelled `app: NAME` (its selector) and
/// `labels`.
pub fn deployment(
    name: &str,
    replicas: i32,
    labels: &[(&str, &str)],
    pod_spec: serde_json::Value,
) -> k8s_openapi::api::apps::v1::Deployment {
    let mut template_labels = serde_json::json!({"app": name});
    for (key, value) in labels {
        template_labels[*key] = serde_json::json!(value);
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": template_labels}, "spec": pod_spec},
        }
    }))
    .expect("a Deployment")
}

/// Creates a pod labelled `gpuslice.io/policy`, again until the API server (which loads new
/// admission policies a moment after they are made) stores it with the queue's gate.
pub async fn create_gated(client: &Client, pod: &k8s_openapi::api::core::v1::Pod) {
    create_gated_as(client, pod, |_| true).await
}

/// [`create_gated`], again also until the stored pod is `as_admitted` (the API server loads the
/// admission parameters the operator writes a moment later too).
pub async fn create_gated_as(
    client: &Client,
    pod: &k8s_openapi::api::core::v1::Pod,
    as_admitted: impl Fn(&k8s_openapi::api::core::v1::Pod) -> bool,
) {
    use kube::api::{DeleteParams, PostParams};
    let as_admitted = &as_admitted;
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let name = pod.metadata.name.clone().unwrap_or_default();
    let api: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), namespace);
    eventually("a labelled pod is stored gated", || {
        let (api, name) = (api.clone(), name.clone());
        async move {
            let stored = api
                .create(&PostParams::default(), pod)
                .await
                .map_err(|e| e.to_string())?;
            let gated = stored
                .spec
                .as_ref()
                .and_then(|s| s.scheduling_gates.as_ref())
                .is_some_and(|g| g.iter().any(|g| g.name == "gpuslice.io/queue"));
            if gated && as_admitted(&stored) {
                return Ok(());
            }
            api.delete(&name, &DeleteParams::default().grace_period(0))
                .await
                .map_err(|e| e.to_string())?;
            Err("stored without the gate, or not as admission should have made it".to_string())
        }
    })
    .await;
}

/// A child process (an operator, an agent) killed when the test ends, also when it panics.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The shim's probe program (`shim/tests/programs/probe.c`), built into `dir` against the
/// emulated CUDA driver and NVML copied into `dir/lib`, taken from beside `binary` (a test's
/// `CARGO_BIN_EXE_gpuslice`). Returns the program and the library folder.
pub fn build_probe(binary: &Path, dir: &Path) -> (PathBuf, PathBuf) {
    let built = binary
        .parent()
        .expect("a binary has a folder")
        .to_path_buf();
    let lib = dir.join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    for (name, from) in [
        ("libcuda.so", "libcuda.so"),
        ("libcuda.so.1", "libcuda.so"),
        ("libnvidia-ml.so", "libnvidia_ml.so"),
        ("libnvidia-ml.so.1", "libnvidia_ml.so"),
    ] {
        let newest = gpuslice_runtime::built::newest_built(&built, from)
            .unwrap_or_else(|| panic!("{from} is not built: cargo build --workspace"));
        std::fs::copy(newest, lib.join(name)).unwrap();
    }
    let program = dir.join("probe");
    let source = repo_root().join("shim/tests/programs/probe.c");
    let cc = Command::new("cc")
        .args(["-O1", "-o"])
        .arg(&program)
        .arg(source)
        .arg(format!("-L{}", lib.display()))
        .args(["-lcuda", "-lnvidia-ml", "-ldl"])
        .output()
        .unwrap();
    assert!(
        cc.status.success(),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    (program, lib)
}

/// The devices a ResourceClaim was allocated (none while it is not).
pub fn allocated_devices(
    claim: k8s_openapi::api::resource::v1::ResourceClaim,
) -> Vec<k8s_openapi::api::resource::v1::DeviceRequestAllocationResult> {
    claim
        .status
        .and_then(|s| s.allocation)
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .unwrap_or_default()
}
