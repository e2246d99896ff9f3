//! The chart's dashboard and alerts against a real Prometheus (built by
//! `tests/prometheus/build.sh`) scraping the real operator and agent: a private control plane with
//! the chart's admission policies, a kwok node with two emulated A100s, a pool of software slices
//! and pods on them through the queue, and a workload under the shim (`gpuslice run`, the
//! emulated CUDA driver) that fills its slice past the cap and launches kernels. Every dashboard
//! query and every alert evaluates without error, the ones that describe what runs return series,
//! `promtool` accepts the rules, and the alerts fire when a slice refuses allocations at its cap (an XID is counted too),
//! when a pool is Degraded and when the agent is down.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use gpuslice_testcluster::{
    Components, ControlPlane, KillOnDrop, built_tool, eventually, free_port, local_get,
};
use k8s_openapi::api::core::v1::Pod;

/// `GET /api/v1/<path>?query=<promql>` on Prometheus: the `data` of a successful answer, or why not.
fn prometheus_api(port: u16, path: &str, query: Option<&str>) -> Result<serde_json::Value, String> {
    let url = match query {
        Some(q) => format!(
            "/api/v1/{path}?{}",
            form_urlencoded::Serializer::new(String::new())
                .append_pair("query", q)
                .finish()
        ),
        None => format!("/api/v1/{path}"),
    };
    let (status, body) = local_get(port, &url).map_err(|e| e.to_string())?;
    let answer: serde_json::Value =
        serde_json::from_str(&body).map_err(|e| format!("{status}: {e}: {body}"))?;
    if answer["status"] != "success" {
        return Err(format!("{status}: {body}"));
    }
    Ok(answer["data"].clone())
}

const POOL: &str = "
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: watched}
spec:
  nodeSelector: {matchLabels: {gpuslice.io/pool: watched}}
  layout: {software: {slices: 2, memory: 38Gi, compute: 50}}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: inference}
spec: {pool: watched, class: inference, memory: 16Gi, compute: {limit: 50, guarantee: 25}}
";

/// Panels whose queries may rightly return nothing here: no preemption, no eviction, a wait
/// histogram that may have had its only admissions before the first scrape, and the workloads'
/// own metrics (nothing here serves them).
const MAY_BE_EMPTY: [&str; 4] = [
    "Preemptions and checkpoints",
    "Wait before admission (p90)",
    "Inference p99 latency (workload metric)",
    "Training iterations per second (workload metric)",
];

#[tokio::test]
async fn dashboards_and_alerts_evaluate_against_a_real_prometheus() {
    let Some(prometheus) = built_tool("GPUSLICE_PROMETHEUS_DIR", "prometheus", "") else {
        return;
    };
    let Some(helm) = built_tool("GPUSLICE_HELM", "helm", "") else {
        return;
    };
    let Some(cluster) = ControlPlane::start(Components::all()).await.unwrap() else {
        return;
    };
    let client = cluster.client_with_crds().await;
    // The chart, rendered with the alerts as a rule file and the dashboard; alerts fire at once.
    let chart = gpuslice_testcluster::render_chart(
        &helm,
        "gpuslice-system",
        &[
            "metrics.alertsConfigMap=true",
            "metrics.dashboard.enabled=true",
            "metrics.prometheusRule.degradedFor=0s",
            "metrics.prometheusRule.agentDownFor=0s",
        ],
    );
    let config_map = |name: &str| {
        chart
            .iter()
            .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("the chart renders ConfigMap {name}"))
            .clone()
    };
    let rules = config_map("gs-alerts")["data"]["gpuslice.rules.yaml"]
        .as_str()
        .unwrap()
        .to_string();
    let dashboard: serde_json::Value = serde_json::from_str(
        config_map("gs-dashboard")["data"]["gpuslice.json"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let admission: Vec<serde_json::Value> = chart
        .iter()
        .filter(|d| {
            d["kind"]
                .as_str()
                .is_some_and(|k| k.starts_with("MutatingAdmissionPolicy") || k == "PriorityClass")
        })
        .cloned()
        .collect();
    gpuslice_testcluster::apply_all(&client, &admission).await;
    // The operator and the agent run as the chart's identities.
    cluster.install_chart_identities().await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let rules_file = dir.path().join("gpuslice.rules.yaml");
    std::fs::write(&rules_file, &rules).unwrap();
    let checked = Command::new(prometheus.join("promtool"))
        .args(["check", "rules"])
        .arg(&rules_file)
        .output()
        .unwrap();
    assert!(
        checked.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );

    // The node, its agent and the operator, each serving /metrics.
    cluster
        .create_node(
            "a100-m",
            &[("gpuslice.io/pool", "watched")],
            &[("cpu", "8")],
        )
        .await
        .unwrap();
    let node_file = dir.path().join("node.yaml");
    std::fs::write(
        &node_file,
        "name: a100-m\ngpus:\n- {index: 0, model: NVIDIA A100-SXM4-80GB}\n- {index: 1, model: NVIDIA A100-SXM4-80GB}\n",
    )
    .unwrap();
    let (agent_port, operator_port, prometheus_port) = (
        free_port().unwrap(),
        free_port().unwrap(),
        free_port().unwrap(),
    );
    let bin = env!("CARGO_BIN_EXE_gpuslice");
    let agent = KillOnDrop(
        gpuslice_testcluster::agent_command(
            bin,
            "1s",
            &node_file,
            &dir.path().join("state"),
            &dir.path().join("kubelet"),
            &dir.path().join("cdi"),
        )
        .args(["--metrics-addr", &format!("127.0.0.1:{agent_port}")])
        .env(
            "KUBECONFIG",
            cluster.agent_kubeconfig("a100-m").await.unwrap(),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap(),
    );
    let _operator = gpuslice_testcluster::spawn_operator(
        bin,
        &cluster.operator_kubeconfig().await.unwrap(),
        None,
        &["--metrics-addr", &format!("127.0.0.1:{operator_port}")],
    );
    gpuslice_testcluster::apply_all(&client, &gpuslice_testcluster::documents(POOL)).await;
    // Five pods for four slices: four are admitted, one waits in the queue.
    for i in 0..5 {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("serve-{i}"), "labels": {"gpuslice.io/policy": "inference"}},
            "spec": {
                "containers": [{"name": "main", "image": "example.com/serve:1"}],
                "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
            }
        }))
        .unwrap();
        gpuslice_testcluster::create_gated(&client, &pod).await;
    }

    // Prometheus scrapes both as the chart's Services and ServiceMonitors name them.
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
             rule_files: [{rules}]\n\
             scrape_configs:\n\
             - job_name: gs-agent-metrics\n  static_configs: [{{targets: ['127.0.0.1:{agent_port}']}}]\n\
             - job_name: gs-operator-metrics\n  static_configs: [{{targets: ['127.0.0.1:{operator_port}']}}]\n",
            rules = rules_file.display()
        ),
    )
    .unwrap();
    let checked = Command::new(prometheus.join("promtool"))
        .args(["check", "config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        checked.status.success(),
        "promtool check config: {}",
        String::from_utf8_lossy(&checked.stdout)
    );
    let _prometheus = KillOnDrop(
        Command::new(prometheus.join("prometheus"))
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prometheus_port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let scalar = |query: &'static str| async move {
        let data = prometheus_api(prometheus_port, "query", Some(query))?;
        data["result"][0]["value"][1]
            .as_str()
            .and_then(|v| v.parse::<f64>().ok())
            .ok_or_else(|| format!("{query}: {data}"))
    };
    eventually(
        "Prometheus sees four slices allocated and one pod waiting",
        || async move {
            let allocated = scalar("sum(gpuslice_pool_slices_allocated{pool=\"watched\"})").await?;
            let waiting = scalar("sum(gpuslice_queue_waiting_pods{pool=\"watched\"})").await?;
            let slices = scalar("count(gpuslice_agent_slice_memory_bytes)").await?;
            (allocated == 4.0 && waiting == 1.0 && slices == 4.0)
                .then_some(())
                .ok_or(format!(
                    "allocated {allocated}, waiting {waiting}, slices {slices}"
                ))
        },
    )
    .await;
    // Every rule evaluated without error; nothing fires yet but the waiting pod's nothing.
    let rules_seen = eventually("every alert rule evaluated", || async move {
        let data = prometheus_api(prometheus_port, "rules", None)?;
        let rules: Vec<serde_json::Value> = data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        let pending: Vec<String> = rules
            .iter()
            .filter(|r| r["health"] != "ok")
            .map(|r| format!("{}: {} {}", r["name"], r["health"], r["lastError"]))
            .collect();
        (rules.len() >= 6 && pending.is_empty())
            .then_some(rules.len())
            .ok_or(format!("{} rules, not ok: {pending:?}", rules.len()))
    })
    .await;
    assert_eq!(rules_seen, 8);
    // Each firing alert: its name and the label that says where.
    let firing = || async move {
        let data = prometheus_api(prometheus_port, "alerts", None)?;
        Ok::<Vec<(String, String)>, String>(
            data["alerts"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|a| a["state"] == "firing")
                .map(|a| {
                    let label = |name: &str| a["labels"][name].as_str().unwrap_or_default();
                    let name = label("alertname").to_string();
                    let place = if label("slice").is_empty() {
                        label("pool").to_string()
                    } else {
                        format!("{}:{}", label("slice"), label("policy"))
                    };
                    (name, place)
                })
                .collect(),
        )
    };
    // Nothing is wrong (an evaluation before the first scrapes may have fired the down alerts).
    eventually("no alert fires", || async move {
        let alerts = firing().await?;
        alerts.is_empty().then_some(()).ok_or(format!("{alerts:?}"))
    })
    .await;

    // A workload under the shim on one of the slices: it fills the slice with 1 GiB allocations
    // until one is refused, tries seven kinds of allocation past what is left (refused too),
    // frees it all, launches kernels now and then for a while (the arbiter grants its slice the
    // GPU each time), and stays.
    let (probe, lib) = gpuslice_testcluster::build_probe(Path::new(bin), dir.path());
    let machine =
        gpuslice_contract::StateDir::new(dir.path().join("state")).emulated_machine("a100-m");
    let stop = dir.path().join("stop");
    let _workload = KillOnDrop(
        Command::new(bin)
            .arg("run")
            .arg("--state")
            .arg(dir.path().join("state"))
            .args(["--policy", "inference", "--", "sh", "-c"])
            .arg(format!(
                "{probe} link cap && for i in $(seq 40); do {probe} link count launch 2000; sleep 0.2; done; until [ -e {stop} ] || [ ! -d {dir} ]; do sleep 0.2; done",
                probe = probe.display(),
                stop = stop.display(),
                dir = dir.path().display()
            ))
            .env("LD_LIBRARY_PATH", &lib)
            .env("GPUSLICE_EMULATOR_STATE", &machine)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    // However the test ends, the workload's shell ends too (killing `gpuslice run` leaves it):
    // by the stop file, or by its folder gone when the stop file was removed with it unseen.
    struct Touch(std::path::PathBuf);
    impl Drop for Touch {
        fn drop(&mut self) {
            let _ = std::fs::write(&self.0, b"");
        }
    }
    let _stop_workload = Touch(stop.clone());
    eventually(
        "Prometheus sees the slice's refusals, high-water mark and GPU time",
        || async move {
            // The counters name the slice; who holds it comes from slice_holder.
            let refusals = scalar(
                "sum(gpuslice_agent_slice_memory_refusals_total * on (instance, slice) group_left () gpuslice_agent_slice_holder{policy=\"inference\", class=\"inference\"})",
            )
            .await?;
            // `gpuslice run` caps the workload at its slice: 38 GiB.
            let peak = scalar("max(gpuslice_agent_slice_memory_peak_bytes{policy=\"inference\"})").await?;
            let used = scalar("sum(gpuslice_agent_slice_compute_used_seconds_total * on (instance, slice) group_left () gpuslice_agent_slice_holder{policy=\"inference\"})").await?;
            let grants = scalar("sum(gpuslice_agent_slice_compute_grants_total * on (instance, slice) group_left () gpuslice_agent_slice_holder{policy=\"inference\"})").await?;
            let cap = 38.0 * 1024.0 * 1024.0 * 1024.0;
            (refusals >= 8.0 && peak > 0.9 * cap && peak <= cap && used > 0.0 && grants > 0.0)
                .then_some(())
                .ok_or(format!(
                    "refusals {refusals}, peak {peak} of {cap}, GPU time {used} s, grants {grants}"
                ))
        },
    )
    .await;
    // GPU 1 reports an XID (48, a double-bit ECC error): the agent hears it from NVML's events.
    gpuslice_emulator::Store::open(&machine)
        .unwrap()
        .mutate(|m| m.inject_xid(1, 48))
        .unwrap()
        .unwrap();
    eventually("Prometheus counts the XID", || async move {
        let xids =
            scalar("sum(gpuslice_agent_gpu_xid_errors_total{gpu=\"1\", xid=\"48\"})").await?;
        (xids == 1.0).then_some(()).ok_or(format!("{xids} XIDs"))
    })
    .await;
    // A few more scrapes, so that rates over the range have two samples.
    tokio::time::sleep(Duration::from_secs(5)).await;

    // Every panel's query evaluates; those about what runs here return series.
    let mut empty = Vec::new();
    let mut checked = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        let title = panel["title"].as_str().unwrap_or_default();
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            let data = prometheus_api(prometheus_port, "query", Some(expr))
                .unwrap_or_else(|e| panic!("panel {title}: {expr}: {e}"));
            checked += 1;
            if data["result"].as_array().is_none_or(|r| r.is_empty())
                && !MAY_BE_EMPTY.contains(&title)
            {
                empty.push(format!("{title}: {expr}"));
            }
        }
    }
    assert!(checked >= 20, "{checked} queries");
    assert!(empty.is_empty(), "panels without series: {empty:#?}");

    eventually(
        "GpuSliceMemoryCapRefusals fires for the workload's slice",
        || async move {
            let alerts = firing().await?;
            alerts
                .iter()
                .any(|(name, place)| {
                    name == "GpuSliceMemoryCapRefusals" && place.ends_with(":inference")
                })
                .then_some(())
                .ok_or(format!("{alerts:?}"))
        },
    )
    .await;
    let alerts = firing().await.unwrap();
    assert!(
        alerts
            .iter()
            .all(|(name, _)| name == "GpuSliceMemoryCapRefusals"),
        "only the cap alert fires: {alerts:?}"
    );

    // A second pool over the same GPUs: both are Degraded, and the alert names them.
    gpuslice_testcluster::apply_all(
        &client,
        &gpuslice_testcluster::documents(
            "
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: clash}
spec:
  nodeSelector: {matchLabels: {gpuslice.io/pool: watched}}
  layout: {exclusive: {}}
",
        ),
    )
    .await;
    eventually(
        "GpuSlicePoolDegraded fires for the clashing pools",
        || async move {
            let alerts = firing().await?;
            let degraded = |pool: &str| {
                alerts
                    .iter()
                    .any(|(name, p)| name == "GpuSlicePoolDegraded" && p == pool)
            };
            (degraded("clash") && degraded("watched"))
                .then_some(())
                .ok_or(format!("{alerts:?}"))
        },
    )
    .await;

    // The agent stops: its target goes down and the alert says so.
    drop(agent);
    eventually("GpuSliceAgentDown fires", || async move {
        let alerts = firing().await?;
        alerts
            .iter()
            .any(|(name, _)| name == "GpuSliceAgentDown")
            .then_some(())
            .ok_or(format!("{alerts:?}"))
    })
    .await;
}
