//! `gpuslice plan` on the example repository and inventory: the window in force decides the
//! layout, matching instances are kept, busy ones block, and a GPU claimed twice is an error.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_gpuslice");

fn plan(at: &str, inventory: &Path) -> (Option<i32>, Value) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(BIN)
        .args([
            "plan",
            root.join("examples/gitops").to_str().unwrap(),
            "--nodes",
            inventory.to_str().unwrap(),
            "--at",
            at,
            "--output",
            "json",
        ])
        .output()
        .unwrap();
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
