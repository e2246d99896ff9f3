//! `gpuslice demo`: the cluster path on one machine, in one command. A private control plane
//! (with kube-scheduler, the controller-manager and kwok nodes labelled for the example pools),
//! the chart's CRDs, identities and admission policies, the operator and one emulated agent per
//! node as local processes under the chart's own ServiceAccounts, every host path they use in
//! the demo's folder, and `examples/gitops` applied. It prints what to try; dropping the
//! [`Demo`] stops every process and deletes the folder.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use chrono::{DateTime, FixedOffset, TimeDelta, Utc};
use kube::Client;

use crate::{CHART_NAMESPACE, CHART_RELEASE, Components, ControlPlane, KillOnDrop};

/// Why the demo could not start.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    ControlPlane(#[from] crate::Error),
    #[error("helm is not built: run `bash tests/helm/build.sh` once (or set GPUSLICE_HELM)")]
    NoHelm,
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("helm template {chart}: {stderr}")]
    Helm { chart: String, stderr: String },
    #[error("{file}: {message}")]
    Example { file: String, message: String },
    #[error("{what} did not happen within {seconds} s: {last}")]
    Timeout {
        what: String,
        seconds: u64,
        last: String,
    },
    #[error(transparent)]
    Kube(#[from] kube::Error),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DemoError {
    let what = what.into();
    move |source| DemoError::Io { what, source }
}

/// The demo's nodes: one GPU each, labelled for the example pools.
const NODES: [DemoNode; 3] = [
    DemoNode {
        name: "a100-0",
        pool: "shared-a100",
        model: "NVIDIA A100-SXM4-80GB",
    },
    DemoNode {
        name: "h200-0",
        pool: "h200-mig",
        model: "NVIDIA H200",
    },
    DemoNode {
        name: "h100-0",
        pool: "research-h100",
        model: "NVIDIA H100 80GB HBM3",
    },
];

struct DemoNode {
    name: &'static str,
    pool: &'static str,
    model: &'static str,
}

/// How long before a window change re-cuts a GPU its slices stop taking new pods (the agent's
/// `--recut-lookahead`; a real node's default is 10 minutes, too long for a demo).
const RECUT_LOOKAHEAD: &str = "30s";

/// What the demo needs from its caller.
pub struct DemoOptions {
    /// The `gpuslice` binary that runs the operator and the agents.
    pub gpuslice: PathBuf,
    /// The repository checkout: `crds/`, `charts/gpuslice` and `examples/gitops` are read from it.
    pub repo: PathBuf,
    /// The clock the operator and agents read: start here (RFC 3339), or `None` to start it so
    /// that the example pools' first window change comes `window_in` after the start.
    pub clock: Option<DateTime<FixedOffset>>,
    pub window_in: Duration,
}

/// A running demo. Dropping it stops the operator, the agents and the control plane and
/// deletes the demo's folder.
pub struct Demo {
    // Processes first: they stop before the control plane they talk to.
    _processes: Vec<KillOnDrop>,
    cluster: ControlPlane,
    clock_start: DateTime<Utc>,
    window_change: Option<WindowChange>,
}

/// The first window change of the example pools on the demo's clock.
struct WindowChange {
    at: DateTime<Utc>,
    pool: String,
    /// `window <name>`, or `the default layout`.
    to: String,
}

impl Demo {
    /// Starts everything and returns once a labelled pod would be queued.
    pub async fn start(options: &DemoOptions) -> Result<Demo, DemoError> {
        crate::locate_binaries()?;
        let helm = crate::find_built_tool("GPUSLICE_HELM", "helm", "").ok_or(DemoError::NoHelm)?;
        let examples = read_examples(&options.repo.join("examples/gitops"))?;
        let (clock_start, window_change) =
            choose_clock(&examples, options.clock, options.window_in, Utc::now());

        let cluster = ControlPlane::start(Components::all())
            .await?
            .ok_or_else(|| {
                crate::Error::Missing("run `bash tests/controlplane/build.sh`".into())
            })?;
        let admin = cluster.client().await?;
        crate::install_crds(&admin, &options.repo.join("crds")).await?;
        apply_chart(&admin, &helm, &options.repo.join("charts/gpuslice")).await?;

        let dir = cluster.dir().to_path_buf();
        let logs = dir.join("logs");
        std::fs::create_dir_all(&logs).map_err(io(logs.display().to_string()))?;
        let clock = clock_start.to_rfc3339();
        let mut processes = Vec::new();
        for node in &NODES {
            cluster
                .create_node(node.name, &[("gpuslice.io/pool", node.pool)], &[])
                .await?;
            let kubeconfig = cluster.agent_kubeconfig(node.name).await?;
            processes.push(spawn_agent(options, node, &dir, &kubeconfig, &clock)?);
        }
        let kubeconfig = cluster.operator_kubeconfig().await?;
        let operator = Command::new(&options.gpuslice)
            .args(["operator", "--lease-namespace", CHART_NAMESPACE])
            .arg(format!(
                "--admission-params={CHART_NAMESPACE}/{CHART_RELEASE}-policies"
            ))
            .env("KUBECONFIG", kubeconfig)
            .env(gpuslice_runtime::clock::CLOCK_START_VAR, &clock)
            .stdout(Stdio::null())
            .stderr(log_file(&logs.join("operator.log"))?)
            .spawn()
            .map_err(io(format!("starting {}", options.gpuslice.display())))?;
        processes.push(KillOnDrop(operator));

        apply_documents(&admin, &examples).await?;
        write_tries(&dir)?;
        write_env(&cluster)?;
        let demo = Demo {
            _processes: processes,
            cluster,
            clock_start,
            window_change,
        };
        demo.wait_until_ready(&admin, &examples).await?;
        Ok(demo)
    }

    /// The demo's folder: the control plane's files, each node's host paths, logs, `env.sh` and
    /// the manifests to try.
    pub fn dir(&self) -> &Path {
        self.cluster.dir()
    }

    /// What to run and what to look at, printed when the demo is up.
    pub fn hints(&self) -> String {
        let dir = self.dir().display();
        let nodes: Vec<String> = NODES
            .iter()
            .map(|n| format!("{} (1 × {}, pool {})", n.name, n.model, n.pool))
            .collect();
        let clock = match &self.window_change {
            Some(change) => format!(
                "The demo's clock started at {} (UTC): at {} pool {} changes to {}; {RECUT_LOOKAHEAD} before, its slices stop taking new pods.",
                self.clock_start.format("%Y-%m-%d %H:%M:%S"),
                change.at.format("%H:%M:%S"),
                change.pool,
                change.to,
            ),
            None => format!(
                "The demo's clock started at {} (UTC).",
                self.clock_start.format("%Y-%m-%d %H:%M:%S")
            ),
        };
        format!(
            "\
gpuslice demo is up: Kubernetes at {server}, the operator and an emulated agent per node, examples/gitops applied.
Nodes: {nodes}.
{clock}

  source {dir}/env.sh      # KUBECONFIG, and the control plane's kubectl on PATH

1. Five notebooks (policy notebook, priority low) for the four 20Gi slices of a100-0: four get a slice, the fifth waits in the queue.
  $ kubectl apply -f {dir}/try/notebooks.yaml
  $ kubectl get pods -o wide
  $ kubectl get pod notebook-5 -o jsonpath='{{.status.conditions[?(@.type==\"gpuslice.io/Queued\")].message}}{{\"\\n\"}}'
2. A fine-tune (policy bert-finetune, priority normal) takes a notebook's slice: the notebook is preempted.
  $ kubectl apply -f {dir}/try/finetune.yaml
  $ kubectl get pods -A -o wide
  $ kubectl get events --field-selector reason=Preempted
3. The window change: the pool's WINDOW turns night and a100-0 is re-cut into two 40Gi slices; the pods on the old slices are evicted (on a real node after their checkpoint) and the queue fills the new ones.
  $ kubectl get gpupools
  $ kubectl get resourceslices -o custom-columns=NODE:.spec.nodeName,DEVICES:.spec.devices[*].name
  $ kubectl get events -A --field-selector reason=Resliced
  $ kubectl get gpunodes
4. A MIG slice on the H200 (policy llm-inference, namespace serving).
  $ kubectl apply -f {dir}/try/inference.yaml
  $ kubectl get resourceclaims -n serving
5. The elastic pool: six research notebooks for h100-0, in halves (two slices): the operator cuts the idle GPU in quarters (staged 15 s ahead, the pool's spec untouched), four run, two wait.
  $ kubectl apply -f {dir}/try/research.yaml
  $ kubectl get pods -o wide -l gpuslice.io/policy=research-notebook
  $ kubectl get gpupool research-h100 -o jsonpath='{{.status.elastic.lastRecut.reason}}{{\"\\n\"}}'

Logs: {dir}/logs/. Ctrl-C stops everything and deletes {dir}.",
            server = self.cluster.server(),
            nodes = nodes.join(", "),
        )
    }

    /// Ready: the operator has written every policy's DeviceClass, every agent has published
    /// its slices, and the API server stores a labelled pod gated by the queue.
    async fn wait_until_ready(
        &self,
        admin: &Client,
        examples: &[serde_json::Value],
    ) -> Result<(), DemoError> {
        use k8s_openapi::api::core::v1::Pod;
        use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
        use kube::api::{Api, ListParams, PostParams};
        let policies = examples
            .iter()
            .filter(|d| d["kind"] == "GpuSlicePolicy")
            .count();
        let classes: Api<DeviceClass> = Api::all(admin.clone());
        let slices: Api<ResourceSlice> = Api::all(admin.clone());
        let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
        let probe: Pod = serde_yaml::from_str(&notebook_pod("notebook-probe")).map_err(|e| {
            DemoError::Example {
                file: "try/notebooks.yaml".into(),
                message: e.to_string(),
            }
        })?;
        let dry_run = PostParams {
            dry_run: true,
            ..Default::default()
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let class_count = classes.list(&ListParams::default()).await?.items.len();
            let published: std::collections::BTreeSet<String> = slices
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .filter_map(|s| s.spec.node_name)
                .collect();
            // Refused until the operator has written the admission parameters.
            let probed = pods.create(&dry_run, &probe).await;
            let gated = probed.as_ref().is_ok_and(|pod| {
                pod.spec
                    .as_ref()
                    .and_then(|s| s.scheduling_gates.as_ref())
                    .is_some_and(|g| g.iter().any(|g| g.name == "gpuslice.io/queue"))
            });
            let last = format!(
                "{class_count} of {policies} DeviceClasses, slices published by {published:?}, a labelled pod: {}",
                match &probed {
                    Ok(_) if gated => "gated".to_string(),
                    Ok(_) => "not gated yet".to_string(),
                    Err(e) => e.to_string(),
                }
            );
            if class_count == policies && published.len() == NODES.len() && gated {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err(DemoError::Timeout {
                    what: "the demo becoming ready".into(),
                    seconds: 120,
                    last: format!("{last}; logs in {}", self.dir().join("logs").display()),
                });
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

/// Every document of the example GitOps repository except Argo CD's own and the workloads
/// (which the hints give as pods to try).
fn read_examples(dir: &Path) -> Result<Vec<serde_json::Value>, DemoError> {
    let mut docs = Vec::new();
    for folder in ["namespaces", "policies", "pools"] {
        let folder = dir.join(folder);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&folder)
            .map_err(io(folder.display().to_string()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .collect();
        files.sort();
        for file in files {
            let text = std::fs::read_to_string(&file).map_err(io(file.display().to_string()))?;
            for doc in serde_yaml::Deserializer::from_str(&text) {
                let value: serde_json::Value =
                    serde::Deserialize::deserialize(doc).map_err(|e: serde_yaml::Error| {
                        DemoError::Example {
                            file: file.display().to_string(),
                            message: e.to_string(),
                        }
                    })?;
                if !value.is_null() {
                    docs.push(value);
                }
            }
        }
    }
    Ok(docs)
}

/// The clock's start, and the first window change of the example pools after it (when, which
/// pool, to which window or `the default layout`). Without an explicit start, the clock starts
/// `window_in` before the first instant, after `now`, at which a pool's window opens while every
/// pool is in its default layout (so the demo starts in the default layouts, which its hints
/// describe, at whatever hour it is run).
fn choose_clock(
    examples: &[serde_json::Value],
    start: Option<DateTime<FixedOffset>>,
    window_in: Duration,
    now: DateTime<Utc>,
) -> (DateTime<Utc>, Option<WindowChange>) {
    use gpuslice_planning::cluster::pool_timing;
    let pools: Vec<gpuslice_api::GpuPool> = examples
        .iter()
        .filter(|d| d["kind"] == "GpuPool")
        .filter_map(|d| serde_json::from_value(d.clone()).ok())
        .collect();
    // Each pool's changes after `at`, as (when, pool, window before, window after); a pool with
    // windows changes at least once a week.
    let changes = |at: DateTime<Utc>| {
        pools.iter().flat_map(move |pool| {
            std::iter::successors(Some(pool_timing(pool, at).1), move |timing| {
                timing.next_change.map(|next| pool_timing(pool, next).1)
            })
            .take(30)
            .collect::<Vec<_>>()
            .windows(2)
            .map(|pair| {
                let (before, after) = (&pair[0], &pair[1]);
                (
                    before.next_change.unwrap_or(at),
                    before.pool.clone(),
                    before.window.clone(),
                    after.window.clone(),
                )
            })
            .collect::<Vec<_>>()
        })
    };
    let describe = |window: Option<String>| {
        window.map_or_else(
            || "the default layout".to_string(),
            |w| format!("window {w}"),
        )
    };
    let first_change = |at: DateTime<Utc>| {
        changes(at)
            .min_by_key(|change| change.0)
            .map(|(at, pool, _, after)| WindowChange {
                at,
                pool,
                to: describe(after),
            })
    };
    let start = match start {
        Some(start) => start.with_timezone(&Utc),
        None => {
            let lead = TimeDelta::from_std(window_in).unwrap_or_default();
            // The story starts with every pool in its default layout (four notebooks on the
            // A100's quarters): the next window opening before which none is in a window, so
            // the demo tells the same story whatever the hour it is started at.
            let all_default =
                |at: DateTime<Utc>| pools.iter().all(|p| pool_timing(p, at).1.window.is_none());
            let opening = changes(now)
                .filter(|(_, _, before, after)| before.is_none() && after.is_some())
                .map(|change| change.0)
                .filter(|when| all_default(*when - lead))
                .min();
            match opening {
                Some(when) => when - lead,
                None => now,
            }
        }
    };
    (start, first_change(start))
}

/// The chart as `helm install` would apply it, less what runs: the operator Deployment, the
/// agent DaemonSet and what serves them run here as local processes instead.
async fn apply_chart(admin: &Client, helm: &Path, chart: &Path) -> Result<(), DemoError> {
    let out = Command::new(helm)
        .args(["template", CHART_RELEASE, "--namespace", CHART_NAMESPACE])
        .arg(chart)
        .output()
        .map_err(io(format!("running {}", helm.display())))?;
    if !out.status.success() {
        return Err(DemoError::Helm {
            chart: chart.display().to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    let docs: Vec<serde_json::Value> = crate::documents(&String::from_utf8_lossy(&out.stdout))
        .into_iter()
        .filter(|d| {
            !matches!(
                d["kind"].as_str(),
                Some("Deployment" | "DaemonSet" | "Service" | "PodDisruptionBudget")
            )
        })
        .collect();
    crate::ensure_namespace(admin, CHART_NAMESPACE).await?;
    apply_documents(admin, &docs).await
}

/// Server-side applies each document; the first the server refuses is the error.
async fn apply_documents(admin: &Client, docs: &[serde_json::Value]) -> Result<(), DemoError> {
    let discovery = kube::discovery::Discovery::new(admin.clone()).run().await?;
    for doc in docs {
        let name = format!(
            "{}/{}",
            doc["kind"].as_str().unwrap_or_default(),
            doc["metadata"]["name"].as_str().unwrap_or_default()
        );
        match crate::apply_document(admin, &discovery, doc, false).await {
            Some(result) => result.map_err(|e| DemoError::Example {
                file: name,
                message: e.to_string(),
            })?,
            None => {
                return Err(DemoError::Example {
                    file: name,
                    message: "the API server does not know this kind".into(),
                });
            }
        }
    }
    Ok(())
}

/// One emulated agent for `node`, its host paths under `dir/nodes/<node>`.
fn spawn_agent(
    options: &DemoOptions,
    node: &DemoNode,
    dir: &Path,
    kubeconfig: &Path,
    clock: &str,
) -> Result<KillOnDrop, DemoError> {
    let home = dir.join("nodes").join(node.name);
    for sub in ["state", "cache", "kubelet", "cdi"] {
        std::fs::create_dir_all(home.join(sub)).map_err(io(home.display().to_string()))?;
    }
    let node_file = home.join("node.yaml");
    std::fs::write(
        &node_file,
        format!(
            "name: {}\nlabels: {{gpuslice.io/pool: {}}}\ngpus:\n- {{index: 0, model: {}}}\n",
            node.name, node.pool, node.model
        ),
    )
    .map_err(io(node_file.display().to_string()))?;
    // The kernel log the agent reads XIDs from: a file here instead of the host's /dev/kmsg.
    let kernel_log = home.join("kmsg");
    std::fs::write(&kernel_log, "").map_err(io(kernel_log.display().to_string()))?;
    let child = Command::new(&options.gpuslice)
        .args(["agent", "--kube", "--apply", "--interval", "2s"])
        .args(["--recut-lookahead", RECUT_LOOKAHEAD])
        .arg("--emulate")
        .arg(&node_file)
        .arg("--state")
        .arg(home.join("state"))
        .arg("--cache-root")
        .arg(home.join("cache"))
        .arg("--kubelet-dir")
        .arg(home.join("kubelet"))
        .arg("--cdi-dir")
        .arg(home.join("cdi"))
        .arg("--kernel-log")
        .arg(&kernel_log)
        .env("KUBECONFIG", kubeconfig)
        .env(gpuslice_runtime::clock::CLOCK_START_VAR, clock)
        .stdout(Stdio::null())
        .stderr(log_file(
            &dir.join("logs").join(format!("agent-{}.log", node.name)),
        )?)
        .spawn()
        .map_err(io(format!("starting {}", options.gpuslice.display())))?;
    Ok(KillOnDrop(child))
}

fn log_file(path: &Path) -> Result<std::fs::File, DemoError> {
    std::fs::File::create(path).map_err(io(path.display().to_string()))
}

/// `env.sh`: the admin KUBECONFIG, and the control plane's own kubectl first on PATH (no skew
/// against the API server).
fn write_env(cluster: &ControlPlane) -> Result<(), DemoError> {
    let bin = crate::locate_binaries()?.join("bin");
    let path = cluster.dir().join("env.sh");
    std::fs::write(
        &path,
        format!(
            "export KUBECONFIG={}\nexport PATH={}:\"$PATH\"\n",
            cluster.kubeconfig_path().display(),
            bin.display()
        ),
    )
    .map_err(io(path.display().to_string()))
}

/// A notebook pod: labelled with its policy, as a non-root user (pool shared-a100 requires it).
fn notebook_pod(name: &str) -> String {
    tenant_pod(name, "default", "notebook", "example.com/notebook:1")
}

fn tenant_pod(name: &str, namespace: &str, policy: &str, image: &str) -> String {
    format!(
        "\
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {namespace}
  labels: {{gpuslice.io/policy: {policy}}}
spec:
  securityContext: {{runAsNonRoot: true, runAsUser: 1000}}
  containers:
  - name: main
    image: {image}
    resources: {{requests: {{cpu: 100m}}}}
"
    )
}

/// The manifests the hints apply, in `dir/try`.
fn write_tries(dir: &Path) -> Result<(), DemoError> {
    let tries = dir.join("try");
    std::fs::create_dir_all(&tries).map_err(io(tries.display().to_string()))?;
    let notebooks: Vec<String> = (1..=5)
        .map(|i| notebook_pod(&format!("notebook-{i}")))
        .collect();
    let research: Vec<String> = (1..=6)
        .map(|i| {
            tenant_pod(
                &format!("research-{i}"),
                "default",
                "research-notebook",
                "example.com/notebook:1",
            )
        })
        .collect();
    let files = [
        ("notebooks.yaml", notebooks.join("---\n")),
        ("research.yaml", research.join("---\n")),
        (
            "finetune.yaml",
            tenant_pod("bert-1", "nlp", "bert-finetune", "example.com/bert:1"),
        ),
        (
            "inference.yaml",
            tenant_pod("llm-1", "serving", "llm-inference", "example.com/llm:1"),
        ),
    ];
    for (name, text) in files {
        let path = tries.join(name);
        std::fs::write(&path, text).map_err(io(path.display().to_string()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Started at any hour, the demo's clock starts 90 s before the A100 pool's night window
    /// opens with every example pool in its default layout: never just before the H200's night
    /// (21:00 UTC on weekdays), when the A100 is already in its own night (Shanghai, 20:00–08:00).
    #[test]
    fn the_demo_starts_before_a_window_opens_with_every_pool_in_its_default_layout() {
        let repo = crate::repo_root();
        let examples = read_examples(&repo.join("examples/gitops")).unwrap();
        let at = |s: &str| DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc);
        for (now, start) in [
            // Monday 12:30 UTC: the H200 opens first (21:00), but the A100 is in night then.
            ("2026-12-07T12:30:00Z", "2026-12-08T11:58:30Z"),
            // Monday 03:00 UTC: the A100's night opens at 12:00 UTC (20:00 in Shanghai).
            ("2026-12-07T03:00:00Z", "2026-12-07T11:58:30Z"),
        ] {
            let (clock, change) = choose_clock(&examples, None, Duration::from_secs(90), at(now));
            assert_eq!(clock, at(start), "started at {now}");
            let change = change.unwrap();
            assert_eq!(
                (change.pool.as_str(), change.to.as_str()),
                ("shared-a100", "window night")
            );
        }
    }
}
