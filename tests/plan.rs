//! `gpuslice plan` on the example repository and inventory: the window in force decides the
//! layout, matching instances are kept, busy ones block, and a GPU claimed twice is an error.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_gpuslice");

/// `gpuslice plan` of the example repository for `inventory` at `at`, with `extra` arguments.
fn plan_examples(at: &str, inventory: &Path, extra: &[&str]) -> std::process::Output {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    Command::new(BIN)
        .args([
            "plan",
            root.join("examples/gitops").to_str().unwrap(),
            "--nodes",
            inventory.to_str().unwrap(),
            "--at",
            at,
        ])
        .args(extra)
        .output()
        .unwrap()
}

fn plan(at: &str, inventory: &Path) -> (Option<i32>, Value) {
    let out = plan_examples(at, inventory, &["--output", "json"]);
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code(), json)
}

fn example_inventory() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/inventory/cluster.yaml")
}

fn gpu<'a>(plan: &'a Value, node: &str, index: u64) -> &'a Value {
    plan["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == node)
        .unwrap()["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["index"] == index)
        .unwrap()
}

#[test]
fn by_day_the_default_layouts_apply_and_matching_instances_stay() {
    let (code, plan) = plan("2026-12-02T10:30:00+01:00", &example_inventory());
    assert_eq!(code, Some(0));
    // Already in the desired layout: nothing to do.
    assert_eq!(gpu(&plan, "h200-node-1", 0)["ops"], Value::Array(vec![]));
    // Four 1g + one 3g → keep the 3g and two 1g, replace two 1g with a 2g.
    let ops = gpu(&plan, "h200-node-1", 1)["ops"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(ops.len(), 3, "{ops:?}");
    assert!(
        ops.iter().all(|o| o["profile"] != "3g.71gb"),
        "the 3g instance is kept: {ops:?}"
    );
    // A busy whole-GPU instance blocks and is named.
    let blocked = gpu(&plan, "h200-node-2", 1);
    assert_eq!(blocked["blockedBy"][0]["profile"], "7g.141gb");
    assert_eq!(
        gpu(&plan, "a100-node-1", 0)["desired"]["software"]["slices"],
        4
    );
    assert_eq!(gpu(&plan, "a100-node-1", 0)["ops"], Value::Array(vec![]));
    assert!(gpu(&plan, "t4-node-1", 0).get("pool").is_none());
}

#[test]
fn at_night_in_shanghai_the_a100_pool_reslices_and_busy_slices_block() {
    // 23:00 in Shanghai: the shared-a100 night window is open.
    let (code, plan) = plan("2026-12-02T23:00:00+08:00", &example_inventory());
    assert_eq!(code, Some(0));
    let pools = plan["pools"].as_array().unwrap();
    let a100 = pools.iter().find(|p| p["pool"] == "shared-a100").unwrap();
    assert_eq!(a100["window"], "night");
    assert_eq!(a100["nextChange"], "2026-12-03T00:00:00Z");
    let busy = gpu(&plan, "a100-node-1", 0);
    assert_eq!(busy["blockedBy"][0]["ids"][0], "a100-node-1-0-0");
    let idle = gpu(&plan, "a100-node-1", 1);
    assert_eq!(idle["ops"][0]["op"], "writeSlices");
    assert_eq!(idle["ops"][0]["table"]["slices"], 2);
    assert_eq!(idle["blockedBy"], Value::Array(vec![]));
}

#[test]
fn a_gpu_in_two_pools_is_an_error_naming_both() {
    let tmp = tempfile::tempdir().unwrap();
    let inventory = tmp.path().join("nodes.yaml");
    std::fs::write(
        &inventory,
        "- name: both\n  labels: {gpuslice.io/pool: shared-a100}\n  gpus: [{index: 0, model: NVIDIA A100-SXM4-80GB}]\n",
    )
    .unwrap();
    // A second pool on the same label without a GPU selector.
    let repo = tmp.path().join("repo");
    std::fs::create_dir(&repo).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::copy(
        root.join("examples/gitops/pools/shared-a100.yaml"),
        repo.join("a.yaml"),
    )
    .unwrap();
    std::fs::copy(
        root.join("examples/gitops/policies/checkpoint-standard.yaml"),
        repo.join("c.yaml"),
    )
    .unwrap();
    std::fs::write(
        repo.join("b.yaml"),
        "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata: {name: greedy}\nspec:\n  nodeSelector: {matchLabels: {gpuslice.io/pool: shared-a100}}\n  layout: {exclusive: {}}\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args([
            "plan",
            repo.to_str().unwrap(),
            "--nodes",
            inventory.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("GPU 0 is selected by pools greedy and shared-a100"),
        "{text}"
    );
}

#[test]
fn a_broken_inventory_names_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let inventory = tmp.path().join("nodes.yaml");
    std::fs::write(
        &inventory,
        "- name: n\n  gpus:\n  - index: zero\n    model: NVIDIA H200\n",
    )
    .unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(BIN)
        .args([
            "plan",
            root.join("examples/gitops").to_str().unwrap(),
            "--nodes",
            inventory.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("[0].gpus[0].index"), "{err}");
}

/// One node's file (what `gpuslice agent --emulate` takes) is an inventory too.
#[test]
fn a_single_node_file_is_an_inventory_of_one() {
    let node = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/nodes/h200-node.yaml");
    let (code, plan) = plan("2026-12-02T10:30:00+01:00", &node);
    assert_eq!(code, Some(0), "{plan}");
    let gpu0 = gpu(&plan, "h200-node-1", 0);
    assert_eq!(gpu0["pool"], "h200-mig");
    assert!(!gpu0["ops"].as_array().unwrap().is_empty(), "{gpu0}");
}

/// The cluster's GpuNodes as `kubectl get gpunodes -o yaml` prints them: node h200-a, MIG in the
/// day layout of the example pool on both GPUs; a pod's claim holds GPU 0's 3g.71gb.
const GPUNODES: &str = "
apiVersion: v1
kind: List
items:
- apiVersion: gpuslice.io/v1alpha1
  kind: GpuNode
  metadata: {name: h200-a, generation: 4}
  spec: {}
  status:
    appliedGeneration: 4
    inventory:
      name: h200-a
      labels: {gpuslice.io/pool: h200-mig}
      gpus:
      - index: 0
        model: NVIDIA H200
        mig:
          enabled: true
          instances:
          - {profile: 3g.71gb, placement: {start: 0, size: 4}, processes: [{pid: 0, name: claim on gpu0-mig0-3g.71gb}]}
          - {profile: 2g.35gb, placement: {start: 4, size: 2}}
          - {profile: 1g.18gb, placement: {start: 6, size: 1}}
          - {profile: 1g.18gb, placement: {start: 7, size: 1}}
      - index: 1
        model: NVIDIA H200
        mig:
          enabled: true
          instances:
          - {profile: 3g.71gb, placement: {start: 0, size: 4}}
          - {profile: 2g.35gb, placement: {start: 4, size: 2}}
          - {profile: 1g.18gb, placement: {start: 6, size: 1}}
          - {profile: 1g.18gb, placement: {start: 7, size: 1}}
    claims:
    - {slice: gpu0-mig0-3g.71gb, resourceClaim: serving/llm-0-gpu, pods: [serving/llm-0], policy: llm-inference}
";

fn plan_against(repo: &Path, nodes: &Path, extra: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(BIN)
        .arg("plan")
        .arg(repo)
        .args(["--path", "gitops", "--nodes"])
        .arg(nodes)
        .args(["--at", "2026-12-04T12:00:00Z"])
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_pull_request_is_planned_against_its_base_naming_the_gpus_it_recuts_and_the_pods_in_the_way() {
    let dir = tempfile::tempdir().unwrap();
    let repo_dir = dir.path().join("gpu-config");
    let repo = git2::Repository::init(&repo_dir).unwrap();
    gpuslice_testcluster::copy_dir(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/gitops"),
        &repo_dir.join("gitops"),
    );
    gpuslice_testcluster::commit_all(&repo, "base");
    let nodes = dir.path().join("gpunodes.yaml");
    std::fs::write(&nodes, GPUNODES).unwrap();

    // The same revision changes nothing.
    let (code, text, err) = plan_against(&repo_dir, &nodes, &["--against", "HEAD"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        text.contains("no pool changes") && text.contains("0 of 2 GPUs change"),
        "{text}"
    );

    // The pull request opens the weekday night window (whole GPUs) at 11:00 Berlin instead of 22:00:
    // at 13:00 Berlin both GPUs are re-cut now, and GPU 0's 3g.71gb is held by a pod.
    let pool = repo_dir.join("gitops/pools/h200-mig.yaml");
    let text = std::fs::read_to_string(&pool).unwrap();
    std::fs::write(
        &pool,
        text.replacen("start: \"22:00\"", "start: \"11:00\"", 1),
    )
    .unwrap();
    let (code, md, err) = plan_against(&repo_dir, &nodes, &["--against", "HEAD", "-o", "markdown"]);
    assert_eq!(
        code,
        Some(2),
        "exit 2: it would wait for running work\n{md}{err}"
    );
    for expected in [
        "waits for running work to drain",
        "window changed: night",
        "in force now: default layout → window \"night\"",
        "| h200-a | 0 NVIDIA H200 | h200-mig: MIG 2 × 1g.18gb + 1 × 2g.35gb + 1 × 3g.71gb | h200-mig (night): MIG 1 × 7g.141gb | 5 | busy 3g.71gb at slices 0-3<br>pod serving/llm-0 on gpu0-mig0-3g.71gb, policy llm-inference |",
        "| h200-a | 1 NVIDIA H200 |",
        "2 of 2 GPUs change, 1 of them blocked by running work, 0 with errors",
    ] {
        assert!(md.contains(expected), "missing {expected:?} in\n{md}");
    }
    let (_, json, _) = plan_against(&repo_dir, &nodes, &["--against", "HEAD", "-o", "json"]);
    let diff: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(diff["gpus"].as_array().unwrap().len(), 2);
    assert_eq!(diff["gpus"][1]["head"]["window"], "night");
    assert_eq!(diff["gpus"][1]["blockedBy"], Value::Array(vec![]));

    // Committed, the head can be named as a revision too; with the pod gone it applies at once.
    gpuslice_testcluster::commit_all(&repo, "night from 11:00");
    let idle = dir.path().join("idle.yaml");
    std::fs::write(
        &idle,
        GPUNODES
            .replace(", processes: [{pid: 0, name: claim on gpu0-mig0-3g.71gb}]", "")
            .replace(
                "    claims:\n    - {slice: gpu0-mig0-3g.71gb, resourceClaim: serving/llm-0-gpu, pods: [serving/llm-0], policy: llm-inference}\n",
                "",
            ),
    )
    .unwrap();
    let (code, text, err) =
        plan_against(&repo_dir, &idle, &["--ref", "HEAD", "--against", "HEAD~1"]);
    assert_eq!(code, Some(0), "{text}{err}");
    assert!(text.contains("plan HEAD against HEAD~1"), "{text}");
    assert!(
        text.contains("2 of 2 GPUs change, 0 of them blocked"),
        "{text}"
    );

    // A head that does not validate is not planned; the error names the file and field.
    let text = std::fs::read_to_string(&pool).unwrap();
    std::fs::write(&pool, text.replacen("3g.71gb: 1", "3g.71gb: 0", 1)).unwrap();
    let (code, _, err) = plan_against(&repo_dir, &idle, &["--against", "HEAD"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("h200-mig.yaml:") && err.contains("spec.layout.mig.profiles"),
        "{err}"
    );

    // A GpuNode whose agent has not reported cannot be planned; the error says which and why.
    std::fs::write(
        &idle,
        "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: gpuslice.io/v1alpha1, kind: GpuNode, metadata: {name: new-node}, spec: {}}\n",
    )
    .unwrap();
    let (code, _, err) = plan_against(&repo_dir, &idle, &["--against", "HEAD~1"]);
    assert_ne!(code, Some(0));
    assert!(
        err.contains("items[0].status.inventory")
            && err.contains("GpuNode new-node has no inventory yet"),
        "{err}"
    );
}

/// `gpuslice plan --compaction` on the cluster's GpuNodes: the A100 pool compacts a node whose
/// GPU 0 holds one notebook while GPU 1 has a free slice beside three; a non-preemptible
/// workload keeps its GPU.
#[test]
fn the_compaction_plan_empties_the_least_used_gpu_into_one_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let nodes = dir.path().join("gpunodes.yaml");
    let claim = |slice: &str, name: &str, policy: &str| {
        format!(
            "    - {{slice: {slice}, resourceClaim: ml/{name}, pods: [ml/{name}], policy: {policy}}}\n"
        )
    };
    let mut text = String::from(
        "apiVersion: v1\nkind: List\nitems:\n- apiVersion: gpuslice.io/v1alpha1\n  kind: GpuNode\n  metadata: {name: a100-a}\n  spec: {}\n  status:\n    inventory:\n      name: a100-a\n      labels: {gpuslice.io/pool: shared-a100}\n      gpus:\n      - {index: 0, model: NVIDIA A100-SXM4-80GB, slices: [{id: gpu0-s0, memory: 20Gi, compute: 25}, {id: gpu0-s1, memory: 20Gi, compute: 25}, {id: gpu0-s2, memory: 20Gi, compute: 25}, {id: gpu0-s3, memory: 20Gi, compute: 25}]}\n      - {index: 1, model: NVIDIA A100-SXM4-80GB, slices: [{id: gpu1-s0, memory: 20Gi, compute: 25}, {id: gpu1-s1, memory: 20Gi, compute: 25}, {id: gpu1-s2, memory: 20Gi, compute: 25}, {id: gpu1-s3, memory: 20Gi, compute: 25}]}\n      - {index: 2, model: NVIDIA A100-SXM4-80GB, slices: [{id: gpu2-s0, memory: 20Gi, compute: 25}, {id: gpu2-s1, memory: 20Gi, compute: 25}, {id: gpu2-s2, memory: 20Gi, compute: 25}, {id: gpu2-s3, memory: 20Gi, compute: 25}]}\n    claims:\n",
    );
    text.push_str(&claim("gpu0-s0", "nb-0", "notebook"));
    for (i, s) in ["gpu1-s0", "gpu1-s1", "gpu1-s2"].iter().enumerate() {
        text.push_str(&claim(s, &format!("nb-{}", i + 1), "notebook"));
    }
    text.push_str(&claim("gpu2-s0", "serve-0", "llm-inference"));
    std::fs::write(&nodes, text).unwrap();
    let out = plan_examples("2026-12-02T10:00:00Z", &nodes, &["--compaction"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("pool shared-a100 (threshold 30 %): 1 GPUs freed by 1 moves"),
        "{text}"
    );
    assert!(
        text.contains("move ml/nb-0: a100-a/gpu0 → a100-a/gpu1"),
        "{text}"
    );
}

/// `gpuslice plan REPO --nodes NODES --elastic --at 2026-12-07T10:00:00Z EXTRA…`: what it
/// prints, which must be a success.
fn plan_elastic(repo: &Path, nodes: &Path, extra: &[&str]) -> String {
    let out = Command::new(BIN)
        .arg("plan")
        .arg(repo)
        .arg("--nodes")
        .arg(nodes)
        .args(["--at", "2026-12-07T10:00:00Z", "--elastic"])
        .args(extra)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The README's worked example: `examples/gitops`'s research-h100 pool on the node of
/// `examples/inventory/research-gpunodes.yaml`. Nothing waits: nothing moves, and the busy GPUs
/// say why. Six notebooks wait: the idle GPU is cut in quarters, and of the three busy ones the
/// one whose notebook has been idle since its checkpoint is drained ("losing no work"), not the
/// training runs that compute.
#[test]
fn the_readme_elastic_example_re_cuts_the_idle_gpu_and_drains_the_one_that_loses_nothing() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let run = |waiting: &str| {
        plan_elastic(
            &root.join("examples/gitops"),
            &root.join("examples/inventory/research-gpunodes.yaml"),
            &["--waiting", waiting],
        )
    };
    let quiet = run("research-notebook=0");
    assert!(
        quiet.contains("pool research-h100: GPUs per shape: halves 4"),
        "{quiet}"
    );
    assert!(quiet.contains("decision: no re-cut"), "{quiet}");
    assert!(
        quiet.contains("waiting for: 3 GPU(s) holding work drained only for waiting pods"),
        "{quiet}"
    );
    let busy = run("research-notebook=6");
    assert!(
        busy.contains(
            "decision: 1 GPU(s) halves → quarters, 1 GPU(s) halves → quarters (drained) (losing no work: idle since the last checkpoints)"
        ),
        "{busy}"
    );
    let staged: Vec<&str> = busy
        .lines()
        .filter(|l| l.contains(" at 2026-12-07"))
        .collect();
    assert_eq!(
        staged,
        [
            "  h100-r1/gpu2: halves → quarters at 2026-12-07 10:00:15 UTC",
            "  h100-r1/gpu3: halves → quarters at 2026-12-07 10:00:15 UTC"
        ],
        "{busy}"
    );
}

#[test]
fn the_elastic_plan_re_cuts_the_idle_gpu_for_waiting_pods_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    // GPU 0 holds a small pod's quarter; GPU 1 is idle.
    let quarters = |gpu: u32| -> String {
        (0..4)
            .map(|s| format!("{{id: gpu{gpu}-s{s}, memory: 20Gi, compute: 25}}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let nodes = dir.path().join("gpunodes.yaml");
    std::fs::write(
        &nodes,
        format!(
            "apiVersion: v1\nkind: List\nitems:\n- apiVersion: gpuslice.io/v1alpha1\n  kind: GpuNode\n  metadata: {{name: a100-e}}\n  spec: {{}}\n  status:\n    inventory:\n      name: a100-e\n      labels: {{gpuslice.io/pool: elastic}}\n      gpus:\n      - {{index: 0, model: NVIDIA A100-SXM4-80GB, slices: [{}]}}\n      - {{index: 1, model: NVIDIA A100-SXM4-80GB, slices: [{}]}}\n    claims:\n    - {{slice: gpu0-s2, resourceClaim: ml/small-0, pods: [ml/small-0], policy: small}}\n",
            quarters(0),
            quarters(1)
        ),
    )
    .unwrap();
    let run = |extra: &[&str]| plan_elastic(&repo, &nodes, extra);
    // Nothing waits: both GPUs keep their quarters.
    let quiet = run(&[]);
    assert!(
        quiet.contains("pool elastic: GPUs per shape: quarters 2"),
        "{quiet}"
    );
    assert!(quiet.contains("decision: no re-cut"), "{quiet}");
    // Two pods wait for halves: the idle GPU is re-cut, the busy one is not.
    let busy = run(&["--waiting", "big=2"]);
    assert!(
        busy.contains("a100-e/gpu1: quarters → halves at 2026-12-07 10:00:15 UTC"),
        "{busy}"
    );
    assert!(!busy.contains("a100-e/gpu0:"), "{busy}");
    assert!(busy.contains("demand big (0 running, 2 waiting"), "{busy}");
    assert!(
        busy.contains("waiting for: 1 GPU(s) holding work that may not be drained"),
        "{busy}"
    );
    // A count that is not one is refused by name.
    let out = Command::new(BIN)
        .args(["plan", repo.to_str().unwrap(), "--nodes"])
        .arg(&nodes)
        .args(["--elastic", "--waiting", "big=two"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("\"two\" is not a whole number"),
        "{err}"
    );
}
