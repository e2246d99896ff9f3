//! The node plane against the emulated libnvidia-ml: the real nvml-wrapper code path, the real
//! planning core, one shared device model that a test can also poke (processes come and go).

use std::collections::BTreeMap;

use gpuslice_contract::StateDir;
use gpuslice_emulator::{Machine, Store};
use gpuslice_node::{NvmlGpus, converge_to as converge};
use gpuslice_planning::transition::{Blocker, Desired, SliceTable};

fn mig(pairs: &[(&str, u32)]) -> Desired {
    Desired::Mig(
        pairs
            .iter()
            .map(|(p, n)| (p.to_string(), *n))
            .collect::<BTreeMap<_, _>>(),
    )
}

fn uuid_at(store: &Store, gpu: u32, start: u32) -> Option<String> {
    let m = store.snapshot().unwrap();
    m.gpu(gpu)
        .unwrap()
        .instances
        .iter()
        .find(|i| i.placement.start == start)
        .map(|i| i.uuid.clone())
}

#[test]
fn layouts_converge_incrementally_and_busy_instances_block() {
    let dir = tempfile::tempdir().unwrap();
    let state_file = dir.path().join("gpus.json");
    let slices = StateDir::new(dir.path().join("run"));
    let node: gpuslice_api::NodeInventory = serde_yaml::from_str(
        "name: n\ngpus:\n- {index: 0, model: NVIDIA H200}\n- {index: 1, model: NVIDIA H200}\n",
    )
    .unwrap();
    let store = Store::create(&state_file, &Machine::from_inventory(&node).unwrap()).unwrap();
    // SAFETY: this test binary has a single test, so no other thread reads the environment.
    unsafe { std::env::set_var(gpuslice_contract::env::EMULATOR_STATE, &state_file) };
    let gpus = NvmlGpus::open(Some(&gpuslice_emulator::built_library("libnvidia_ml.so"))).unwrap();

    // A fresh node: MIG on GPU 0, software slices on GPU 1. Without apply nothing changes.
    let day = mig(&[("3g.71gb", 1), ("2g.35gb", 1), ("1g.18gb", 2)]);
    let table = SliceTable {
        slices: 4,
        memory: 35 << 30,
        compute: 25,
        mps: false,
    };
    let want = [(0, day.clone()), (1, Desired::Software(table))];
    let dry = converge(&gpus, "n", &slices, &want, &[], false).unwrap();
    assert!(dry.iter().all(|o| !o.converged && !o.ops.is_empty()));
    assert!(!store.snapshot().unwrap().gpu(0).unwrap().mig_enabled);
    let applied = converge(&gpus, "n", &slices, &want, &[], true).unwrap();
    assert!(
        applied.iter().all(|o| o.converged && o.error.is_none()),
        "{applied:#?}"
    );
    let m = store.snapshot().unwrap();
    assert_eq!(m.gpu(0).unwrap().instances.len(), 4);
    assert!(
        m.gpu(0)
            .unwrap()
            .instances
            .iter()
            .all(|i| i.compute_instances.len() == 1),
        "each instance gets a compute instance"
    );
    // A second pass has nothing to do.
    let again = converge(&gpus, "n", &slices, &want, &[], true).unwrap();
    assert!(
        again.iter().all(|o| o.ops.is_empty() && o.converged),
        "{again:#?}"
    );

    // A window change: the 3g instance stays (same UUID), the small ones make room for another 3g.
    let three_g = uuid_at(&store, 0, 4).expect("the solver put the 3g at slices 4-7");
    let night = mig(&[("3g.71gb", 2)]);
    let out = converge(&gpus, "n", &slices, &[(0, night.clone())], &[], true).unwrap();
    assert!(out[0].converged, "{out:#?}");
    assert_eq!(
        uuid_at(&store, 0, 4),
        Some(three_g.clone()),
        "the unchanged instance keeps its UUID"
    );

    // A process on the 3g instance at 4-7 blocks a change that needs it gone.
    let gi = store
        .snapshot()
        .unwrap()
        .gpu(0)
        .unwrap()
        .instances
        .iter()
        .find(|i| i.placement.start == 4)
        .unwrap()
        .id;
    store
        .update(|m| m.attach_process(0, 777, 8 << 30, Some(gi)))
        .unwrap()
        .unwrap();
    let whole = mig(&[("7g.141gb", 1)]);
    let blocked = converge(&gpus, "n", &slices, &[(0, whole.clone())], &[], true).unwrap();
    assert!(!blocked[0].converged);
    assert!(
        matches!(&blocked[0].blocked_by[..], [Blocker::Instance { profile, .. }] if profile == "3g.71gb"),
        "{blocked:#?}"
    );
    assert_eq!(
        uuid_at(&store, 0, 4),
        Some(three_g),
        "nothing was destroyed"
    );
    assert_eq!(store.snapshot().unwrap().gpu(0).unwrap().instances.len(), 2);
    // Once the process exits, the next pass completes.
    store.update(|m| m.detach_process(777)).unwrap();
    let done = converge(&gpus, "n", &slices, &[(0, whole)], &[], true).unwrap();
    assert!(done[0].converged, "{done:#?}");

    // Software → MIG → software on GPU 1.
    let to_mig = converge(
        &gpus,
        "n",
        &slices,
        &[(1, mig(&[("4g.71gb", 1), ("3g.71gb", 1)]))],
        &[],
        true,
    )
    .unwrap();
    assert!(to_mig[0].converged, "{to_mig:#?}");
    assert!(
        gpuslice_node::gpu::slices::read(&slices, 1)
            .unwrap()
            .is_empty(),
        "the slice table is gone"
    );
    let back = converge(
        &gpus,
        "n",
        &slices,
        &[(1, Desired::Software(table))],
        &[],
        true,
    )
    .unwrap();
    assert!(back[0].converged, "{back:#?}");
    assert!(!store.snapshot().unwrap().gpu(1).unwrap().mig_enabled);
    assert_eq!(
        gpuslice_node::gpu::slices::read(&slices, 1).unwrap().len(),
        4
    );

    // One whole pass of the agent (a pool, planned from the read) reads the node twice: once
    // before planning, once to confirm. Counted by the emulated NVML.
    let pool: gpuslice_api::GpuPool = serde_yaml::from_str(
        "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata: {name: p}\nspec:\n  nodeSelector: {}\n  layout: {mig: {profiles: {3g.71gb: 2}}}\n",
    )
    .unwrap();
    let reads = node_reads();
    let before = reads();
    let agent = gpuslice_node::pass::Agent::new(gpus, &node, slices.clone(), true);
    let now = chrono::Utc::now();
    let pass = agent
        .pass(now, |read| gpuslice_node::pass::Intent {
            plan: gpuslice_planning::cluster::plan_cluster(
                std::slice::from_ref(&pool),
                std::slice::from_ref(read),
                now,
            ),
            config: Default::default(),
            problems: Vec::new(),
            preemptions: Vec::new(),
            gpus_out: Default::default(),
        })
        .unwrap();
    assert!(pass.converged(), "{:#?}", pass.outcomes);
    assert_eq!(pass.outcomes.len(), 2);
    assert!(
        pass.outcomes.iter().any(|o| !o.ops.is_empty()),
        "it changed GPUs"
    );
    assert_eq!(reads() - before, 2, "one pass reads the node exactly twice");
}

/// The emulated NVML's count of whole-node reads in this process.
fn node_reads() -> impl Fn() -> u64 {
    // SAFETY: the emulator's library, already loaded by NVML above; the symbol has this type.
    let library =
        unsafe { libloading::Library::new(gpuslice_emulator::built_library("libnvidia_ml.so")) }
            .unwrap();
    move || {
        // SAFETY: `gpusliceEmulatorNodeReads` takes nothing and returns a u64.
        unsafe {
            let count: libloading::Symbol<unsafe extern "C" fn() -> u64> =
                library.get(b"gpusliceEmulatorNodeReads").unwrap();
            count()
        }
    }
}
