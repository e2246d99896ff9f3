use super::fragment::mix_of;
use super::policies::{BestFit, Fgd, Mix, Random};
use super::*;

fn share(milli: u32) -> Request {
    Request {
        cpu_milli: 1000,
        memory_mib: 1024,
        gpu: GpuAsk::Share(milli),
        models: Vec::new(),
    }
}

#[test]
fn a_share_goes_where_it_fragments_least() {
    // Node 0 has a GPU 60% used; node 1 is idle. A 40% share fills the used GPU exactly.
    let mut used = Node::empty("a", "T4", 32000, 65536, 2);
    used.gpus[0] = Gpu::Shared { free: 400 };
    let idle = Node::empty("b", "T4", 32000, 65536, 2);
    let cluster = Cluster::new(vec![used, idle]);
    let mut fgd = Fgd::new(mix_of(&[share(400), share(600)]));
    let choice = cluster.choose(&share(400), &mut fgd).unwrap();
    assert_eq!((choice.node, choice.gpus.clone()), (0, vec![(0, 400)]));
    let mut ours = Mix::default();
    ours.observe(&share(400));
    assert_eq!(cluster.choose(&share(400), &mut ours).unwrap().node, 0);
}

#[test]
fn a_cpu_task_leaves_the_cpu_that_idle_gpus_will_need() {
    // GPU tasks arrive with 11 cores per GPU. Node 0 (2 idle GPUs, 30 cores) can feed both
    // GPUs only while it keeps 22 cores; node 1 has 64. A 10-core task without GPUs fits on
    // either, and node 0 would still take one more GPU task: only the second GPU is at stake.
    let gpu_task = Request {
        cpu_milli: 11000,
        memory_mib: 1024,
        gpu: GpuAsk::Whole(1),
        models: Vec::new(),
    };
    let cpu_task = Request {
        cpu_milli: 10000,
        memory_mib: 1024,
        gpu: GpuAsk::None,
        models: Vec::new(),
    };
    let cluster = Cluster::new(vec![
        Node::empty("tight", "T4", 30000, 65536, 2),
        Node::empty("roomy", "T4", 64000, 65536, 2),
    ]);
    let mut ours = Mix::default();
    for _ in 0..20 {
        ours.observe(&gpu_task);
    }
    ours.observe(&cpu_task);
    assert_eq!(cluster.choose(&cpu_task, &mut ours).unwrap().node, 1);
}

#[test]
fn a_share_keeps_off_a_gpu_that_its_better_partner_will_fill() {
    // 470s, 650s and 320s arrive equally often: the best packing pairs 470 with 470 (940) and
    // 650 with 320 (970). A 320 on the GPU where a 470 sits (leaving 210, which no expected share
    // fills) spoils a GPU that a second 470 would have filled; on the idle GPU it waits for a 650.
    // Whole-GPU tasks arrive too, so the fragment alone would rather keep the idle GPU whole.
    let mut node = Node::empty("a", "T4", 32000, 65536, 2);
    node.gpus[0] = Gpu::Shared { free: 530 };
    let mut cluster = Cluster::new(vec![node]);
    let mut ours = Mix::default();
    for _ in 0..30 {
        for m in [470, 650, 320] {
            ours.observe(&share(m));
        }
        ours.observe(&Request {
            gpu: GpuAsk::Whole(1),
            ..share(0)
        });
    }
    let choice = cluster.place(&share(320), &mut ours).unwrap();
    assert_eq!(choice.gpus, vec![(1, 320)]);
    // A 470 completes the pair.
    let choice = cluster.place(&share(470), &mut ours).unwrap();
    assert_eq!(choice.gpus, vec![(0, 470)]);
}

#[test]
fn nothing_fits_says_why() {
    let cluster = Cluster::new(vec![Node::empty("a", "T4", 4000, 1024, 1)]);
    let mut policy = BestFit;
    let mut big = share(500);
    big.cpu_milli = 8000;
    assert!(matches!(
        cluster.choose(&big, &mut policy),
        Err(NoFit::CpuMemory { .. })
    ));
    let mut v100 = share(500);
    v100.models = vec!["V100M32".into()];
    assert!(matches!(
        cluster.choose(&v100, &mut policy),
        Err(NoFit::Model(_))
    ));
    let two = Request {
        gpu: GpuAsk::Whole(2),
        ..share(0)
    };
    assert!(matches!(
        cluster.choose(&two, &mut policy),
        Err(NoFit::Gpu(_))
    ));
}

#[test]
fn mig_requests_take_only_free_allowed_placements() {
    let mut node = Node::empty("h", "NVIDIA H200", 64000, 65536, 1);
    node.gpus[0] = Gpu::Mig {
        occupied: 0b0000_1111,
        compute_used: 4,
    };
    let mut cluster = Cluster::new(vec![node]);
    let three_g = Request {
        gpu: GpuAsk::Mig("3g.71gb".into()),
        ..share(0)
    };
    let choice = cluster.choose(&three_g, &mut BestFit).unwrap();
    assert_eq!(choice.mig, Some((0, 4)), "slices 0-3 are taken");
    cluster.allocate(&three_g, &choice);
    assert!(
        cluster.choose(&three_g, &mut BestFit).is_err(),
        "the GPU is full"
    );
}

mod properties {
    use proptest::prelude::*;

    use super::super::policies::{BestFit, DotProd, GpuPacking, Mix, Random};
    use super::super::*;

    fn request() -> impl Strategy<Value = Request> {
        (
            0u64..40_000,
            0u64..100_000,
            prop_oneof![
                Just(GpuAsk::None),
                (1u32..1000).prop_map(GpuAsk::Share),
                (1u32..=8).prop_map(GpuAsk::Whole),
            ],
            prop_oneof![
                Just(vec![]),
                Just(vec!["T4".to_string()]),
                Just(vec!["G2".to_string()])
            ],
        )
            .prop_map(|(cpu_milli, memory_mib, gpu, models)| Request {
                cpu_milli,
                memory_mib,
                gpu,
                models,
            })
    }

    fn nodes() -> Vec<Node> {
        vec![
            Node::empty("t4-0", "T4", 64_000, 262_144, 2),
            Node::empty("t4-1", "T4", 64_000, 262_144, 2),
            Node::empty("g2-0", "G2", 96_000, 786_432, 8),
            // Identical nodes are scored once and one of them picked: GPUs must map across.
            Node::empty("g2-1", "G2", 96_000, 786_432, 8),
            Node::empty("g2-2", "G2", 96_000, 786_432, 8),
            Node::empty("p100", "P100", 32_000, 131_072, 1),
        ]
    }

    /// Whether a request fits a node, by brute force over its GPUs.
    fn fits(node: &Node, r: &Request) -> bool {
        let gpu_ok = match &r.gpu {
            GpuAsk::None => true,
            GpuAsk::Share(m) => node.gpus.iter().any(|g| g.free_milli() >= *m),
            GpuAsk::Whole(k) => {
                node.gpus.iter().filter(|g| g.free_milli() == WHOLE).count() >= *k as usize
            }
            GpuAsk::Mig(_) => false,
        };
        node.cpu_free >= r.cpu_milli
            && node.memory_free >= r.memory_mib
            && gpu_ok
            && (r.gpu == GpuAsk::None || r.allows(&node.model))
    }

    proptest! {
        #[test]
        fn placements_respect_capacity_models_and_never_refuse_what_fits(
            requests in prop::collection::vec(request(), 1..60),
            which in 0usize..5,
        ) {
            let mut policy: Box<dyn Policy> = match which {
                0 => Box::new(Random::new(7)),
                1 => Box::new(DotProd),
                2 => Box::new(GpuPacking),
                3 => Box::new(BestFit),
                _ => Box::new(Mix::new(16)),
            };
            let mut cluster = Cluster::new(nodes());
            for r in &requests {
                policy.observe(r);
                let fits_somewhere = cluster.nodes.iter().any(|n| fits(n, r));
                match cluster.choose(r, policy.as_mut()) {
                    Ok(choice) => {
                        prop_assert!(fits(&cluster.nodes[choice.node], r), "{r:?} on {:?}", cluster.nodes[choice.node]);
                        let given: u64 = choice.gpus.iter().map(|(_, m)| u64::from(*m)).sum();
                        prop_assert_eq!(given, r.gpu_milli());
                        cluster.allocate(r, &choice);
                    }
                    Err(_) => prop_assert!(!fits_somewhere, "{r:?} fits but was refused"),
                }
                for n in &cluster.nodes {
                    prop_assert!(n.cpu_free <= n.cpu_total && n.memory_free <= n.memory_total);
                    prop_assert!(n.gpus.iter().all(|g| g.free_milli() <= WHOLE));
                }
            }
        }
    }
}

#[test]
fn replay_reports_unallocated_at_each_mark() {
    let nodes = vec![Node::empty("a", "T4", 64000, 262_144, 2); 4];
    let pods = vec![share(500), share(700), share(300)];
    let out = replay::replay(&nodes, &pods, 1, &mut Random::new(1), &[100.0, 130.0]);
    assert_eq!(out.unallocated.len(), 2);
    assert!(out.unallocated.iter().all(|u| (0.0..=100.0).contains(u)));
    assert!(
        out.unallocated[1] <= out.unallocated[0] + 1e-9,
        "more arrivals never free GPUs"
    );
}

#[test]
fn unconstrained_work_leaves_a_scarce_model_to_the_tasks_that_can_use_nothing_else() {
    // A V100 GPU with 40% free and an idle T4. Shares of 40% and 50% arrive, and a third of the
    // tasks may only run on V100s. An unconstrained 40% share completes the V100 exactly (the
    // best packing, and FGD's fragment measure ties), but then the next V100-only share has
    // nowhere to go: the share must take the T4.
    let share = |milli: u32, models: &[&str]| Request {
        cpu_milli: 1000,
        memory_mib: 1024,
        gpu: GpuAsk::Share(milli),
        models: models.iter().map(|m| m.to_string()).collect(),
    };
    let v100 = ["V100M16", "V100M32"];
    let (anywhere, v100_only) = (share(400, &[]), share(400, &v100));
    let mut partly_used = Node::empty("v100", "V100M16", 32000, 65536, 1);
    partly_used.gpus[0] = Gpu::Shared { free: 400 };
    let nodes = vec![partly_used, Node::empty("t4", "T4", 32000, 65536, 1)];
    let seen = [anywhere.clone(), share(500, &[]), v100_only.clone()];

    let mut cluster = Cluster::new(nodes.clone());
    let mut ours = Mix::default();
    for r in seen.iter().cycle().take(30) {
        ours.observe(r);
    }
    ours.observe(&anywhere);
    let first = cluster.place(&anywhere, &mut ours).unwrap();
    assert_eq!(cluster.nodes[first.node].model, "T4");
    ours.observe(&v100_only);
    assert!(cluster.place(&v100_only, &mut ours).is_ok());
    assert_eq!(cluster.free_by_model()["V100M16"], 0);

    let mut fgd = Fgd::new(mix_of(&seen));
    let cluster = Cluster::new(nodes);
    assert_eq!(cluster.choose(&anywhere, &mut fgd).unwrap().node, 0);
}
