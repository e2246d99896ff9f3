//! containerd with runc under the real kubelet: real containers from local images, in their own
//! pid and mount namespaces, with CDI applied by containerd itself (tests/containerd/ builds the
//! binaries and the images; its README says what this machine needs).
//!
//! containerd runs in a pid namespace of its own (so that killing it ends its shims and every
//! container) and a private mount namespace, which the kubelet joins: runc must see the mounts
//! the kubelet makes for pods. Only hostNetwork pods run (a loopback-only CNI config keeps the node
//! Ready without a network plugin).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::kubelet::Container;
use crate::{Error, Process, built_tool, io, write};

/// The pod sandbox image every pod gets, imported before the kubelet starts.
pub const SANDBOX_IMAGE: &str = "gpuslice.test/pause:1";

/// What RuntimeClass `nvidia` adds to each of its containers (containerd's handler `nvidia`, from
/// a base spec), as the NVIDIA container runtime gives a GPU node's containers the driver: its
/// files bound in, and environment.
#[derive(Clone, Debug, Default)]
pub struct Driver {
    /// (host path, path in the container, writable).
    pub mounts: Vec<(PathBuf, PathBuf, bool)>,
    pub env: Vec<(String, String)>,
}

pub(crate) struct Containerd {
    process: Process,
    dir: PathBuf,
    bin: PathBuf,
    /// containerd's pid (in this pid namespace): its mount namespace is the kubelet's.
    pid: u32,
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../containerd/{name}"))
}

/// Builds an image tarball with `tests/containerd/image.sh` (busybox and `files`, each
/// `SRC:DEST`, with the shared libraries dynamically linked ones need, as `ldd` finds them under
/// `env`).
pub fn build_image(
    out: &Path,
    name: &str,
    entrypoint: Option<&str>,
    files: &[String],
    env: &[(&str, &Path)],
) {
    let mut command = Command::new("bash");
    command.envs(env.iter().copied());
    command.arg(script("image.sh")).args(["--name", name]);
    if let Some(entrypoint) = entrypoint {
        command.args(["--entrypoint", entrypoint]);
    }
    let built = command.arg(out).args(files).output().unwrap();
    assert!(
        built.status.success(),
        "image.sh: {}",
        String::from_utf8_lossy(&built.stderr)
    );
}

/// A pod spec as a tenant's on these nodes: host network (no CNI here), no API token, user 1000
/// (non-root), one container `main` of a local `image` running `command` on a read-only root
/// filesystem.
pub fn tenant_pod_spec(image: &str, command: &[&str]) -> serde_json::Value {
    serde_json::json!({
        "hostNetwork": true,
        "automountServiceAccountToken": false,
        "enableServiceLinks": false,
        "terminationGracePeriodSeconds": 5,
        "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": true},
        "containers": [{
            "name": "main",
            "image": image,
            "imagePullPolicy": "Never",
            "command": command,
            "securityContext": {"readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false},
        }],
    })
}

/// containerd's default spec (`ctr oci spec`) with the driver's mounts and environment.
fn driver_base_spec(bin: &Path, driver: &Driver) -> Result<serde_json::Value, Error> {
    let out = Command::new(bin.join("ctr"))
        .args(["oci", "spec"])
        .output()
        .map_err(io("running ctr oci spec"))?;
    let mut spec: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| Error::Missing(format!("ctr oci spec: {e}")))?;
    let mounts = spec["mounts"].as_array_mut().expect("a spec has mounts");
    for (host, container, writable) in &driver.mounts {
        mounts.push(serde_json::json!({
            "destination": container,
            "type": "bind",
            "source": host,
            "options": ["rbind", if *writable { "rw" } else { "ro" }],
        }));
    }
    spec["process"]["env"] = driver.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    Ok(spec)
}

impl Containerd {
    /// Starts containerd under `dir` with the sandbox image imported; `None` (the test skips)
    /// when tests/containerd/build.sh has not built it, which under CI fails.
    pub(crate) fn start(dir: &Path, driver: &Driver) -> Result<Option<Containerd>, Error> {
        let Some(root) = built_tool("GPUSLICE_CONTAINERD_DIR", "containerd", "") else {
            return Ok(None);
        };
        let bin = root.join("bin");
        for sub in ["cdi", "cni/net.d", "cni/bin"] {
            std::fs::create_dir_all(dir.join(sub)).map_err(io(format!("creating {sub}")))?;
        }
        let template = std::fs::read_to_string(script("config.toml.in"))
            .map_err(io("reading config.toml.in"))?;
        let config = template
            .replace("@DIR@", &dir.display().to_string())
            .replace("@BIN@", &bin.display().to_string())
            .replace("@SNAPSHOTTER@", "overlayfs")
            .replace("@SANDBOX_IMAGE@", SANDBOX_IMAGE);
        write(&dir.join("config.toml"), &config)?;
        write(
            &dir.join("nvidia-base-spec.json"),
            &driver_base_spec(&bin, driver)?.to_string(),
        )?;
        write(
            &dir.join("cni/net.d/10-none.conflist"),
            r#"{"cniVersion": "1.0.0", "name": "gpuslice-none", "plugins": [{"type": "loopback"}]}"#,
        )?;
        let containerd = bin.join("containerd");
        let process = Process::spawn(
            "containerd",
            Path::new("unshare"),
            &[
                "--mount".into(),
                "--propagation".into(),
                "private".into(),
                "--pid".into(),
                "--fork".into(),
                "--mount-proc".into(),
                "--kill-child".into(),
                "sh".into(),
                "-c".into(),
                // Shims put their sockets in /run/containerd/s whatever the config says.
                format!(
                    "mkdir -p /run/containerd && mount -t tmpfs tmpfs /run/containerd && \
                     exec {} --config {}",
                    containerd.display(),
                    dir.join("config.toml").display()
                ),
            ],
            dir,
        )?;
        let mut containerd = Containerd {
            pid: 0,
            process,
            dir: dir.to_path_buf(),
            bin,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !dir.join("containerd.sock").exists() {
            containerd.process.check_alive()?;
            if Instant::now() > deadline {
                return Err(Error::NotReady {
                    component: "containerd".into(),
                    seconds: 30,
                    log: containerd.process.log_text(),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        containerd.pid = containerd.child_pid()?;
        let pause = dir.join("pause.tar");
        build_image(&pause, SANDBOX_IMAGE, Some("sleep inf"), &[], &[]);
        containerd.import(&pause)?;
        Ok(Some(containerd))
    }

    /// The process `unshare` forked, which became containerd.
    fn child_pid(&self) -> Result<u32, Error> {
        crate::children(self.process.child.id())
            .first()
            .copied()
            .ok_or_else(|| Error::Missing("containerd's process".into()))
    }

    pub(crate) fn socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    pub(crate) fn cdi_dir(&self) -> PathBuf {
        self.dir.join("cdi")
    }

    /// One of containerd's namespaces (`mnt`, `pid`), for the kubelet to join.
    pub(crate) fn namespace(&self, kind: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/{kind}", self.pid))
    }

    /// Imports an image tarball into the namespace the CRI uses.
    pub(crate) fn import(&self, tar: &Path) -> Result<(), Error> {
        let out = Command::new(self.bin.join("ctr"))
            .arg("--address")
            .arg(self.socket())
            .args(["-n", "k8s.io", "images", "import"])
            .arg(tar)
            .output()
            .map_err(io("running ctr"))?;
        if !out.status.success() {
            return Err(Error::Missing(format!(
                "ctr images import {}: {}",
                tar.display(),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(())
    }

    fn crictl(&self, args: &[&str]) -> Option<serde_json::Value> {
        let out = Command::new(self.bin.join("crictl"))
            .arg("--runtime-endpoint")
            .arg(format!("unix://{}", self.socket().display()))
            .args(["--timeout", "10s"])
            .args(args)
            .output()
            .ok()?;
        serde_json::from_slice(&out.stdout).ok()
    }

    /// Every container containerd has, as the kubelet tests read them: pod, CDI devices asked,
    /// environment, state and exit code.
    pub(crate) fn containers(&self) -> Vec<Container> {
        let Some(list) = self.crictl(&["ps", "-a", "-o", "json"]) else {
            return Vec::new();
        };
        let mut all = Vec::new();
        for c in list["containers"].as_array().into_iter().flatten() {
            let Some(id) = c["id"].as_str() else { continue };
            let Some(inspect) = self.crictl(&["inspect", "-o", "json", id]) else {
                continue;
            };
            let status = &inspect["status"];
            let labels = &status["labels"];
            let label = |k: &str| labels[k].as_str().unwrap_or_default().to_string();
            let config = &inspect["info"]["config"];
            let strings = |v: &serde_json::Value| -> Vec<String> {
                v.as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            };
            let state = status["state"].as_str().unwrap_or_default();
            all.push(Container {
                id: id.to_string(),
                namespace: label("io.kubernetes.pod.namespace"),
                pod: label("io.kubernetes.pod.name"),
                pod_uid: label("io.kubernetes.pod.uid"),
                container: label("io.kubernetes.container.name"),
                cdi_devices: config["CDI_devices"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|d| d["name"].as_str().map(str::to_string))
                    .collect(),
                command: [strings(&config["command"]), strings(&config["args"])].concat(),
                env: config["envs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|e| {
                        format!(
                            "{}={}",
                            e["key"].as_str().unwrap_or_default(),
                            e["value"].as_str().unwrap_or_default()
                        )
                    })
                    .collect(),
                started: state == "CONTAINER_RUNNING" || state == "CONTAINER_EXITED",
                exit_code: (state == "CONTAINER_EXITED")
                    .then(|| status["exitCode"].as_i64().map(|c| c as i32))
                    .flatten(),
                log_path: status["logPath"].as_str().map(PathBuf::from),
            });
        }
        all.sort_by(|a, b| (&a.pod, &a.id).cmp(&(&b.pod, &b.id)));
        all
    }

    /// The last lines of containerd's log.
    pub(crate) fn log_text(&self) -> String {
        self.process.log_text()
    }
}

/// What a container printed, from its CRI log file (`<time> <stream> <F|P> <text>` lines).
pub(crate) fn output(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut out = String::new();
    for line in text.lines() {
        let mut parts = line.splitn(4, ' ');
        let (Some(_), Some(_), Some(tag), rest) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        out.push_str(rest.unwrap_or_default());
        if tag == "F" {
            out.push('\n');
        }
    }
    out
}

impl Containerd {
    /// Ends containerd: unshare ignores SIGTERM, so stop() ends with SIGKILL, and the kernel
    /// ends containerd, its shims and every container with the pid namespace.
    pub(crate) fn stop(&mut self) {
        self.process.stop();
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.stop();
    }
}
