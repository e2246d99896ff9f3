use super::*;

fn at(second: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000 + second, 0).unwrap()
}

fn pod(namespace: &str, name: &str, priority: i64, second: i64) -> Waiting {
    Waiting {
        namespace: namespace.into(),
        name: name.into(),
        policy: "notebook".into(),
        priority,
        created: at(second),
        runs_until: None,
        count: 1,
        nvlink: false,
        cpu_milli: 0,
        memory_mib: 0,
    }
}

fn names(pods: &[Waiting], order: &[usize]) -> Vec<String> {
    order.iter().map(|&i| pods[i].name.clone()).collect()
}

#[test]
fn priority_comes_before_arrival_and_fifo_ignores_it() {
    let pods = [pod("a", "early-low", 0, 1), pod("a", "late-high", 100, 2)];
    let shares = BTreeMap::new();
    assert_eq!(
        names(&pods, &order(SchedulingPolicy::Priority, &pods, &shares)),
        ["late-high", "early-low"]
    );
    assert_eq!(
        names(&pods, &order(SchedulingPolicy::Fifo, &pods, &shares)),
        ["early-low", "late-high"]
    );
}

#[test]
fn fair_share_follows_the_weights() {
    // Both namespaces hold nothing; "big" weighs 2, "small" 1: of six places, big gets
    // four and small two, interleaved.
    let pods: Vec<Waiting> = (0..6)
        .map(|i| pod("big", &format!("b{i}"), 0, i))
        .chain((0..6).map(|i| pod("small", &format!("s{i}"), 0, i)))
        .collect();
    let shares = BTreeMap::from([
        (
            "big".to_string(),
            Share {
                weight: 2.0,
                ..Default::default()
            },
        ),
        (
            "small".to_string(),
            Share {
                weight: 1.0,
                ..Default::default()
            },
        ),
    ]);
    let first_six: Vec<String> = names(&pods, &order(SchedulingPolicy::Fair, &pods, &shares))
        .into_iter()
        .take(6)
        .collect();
    let big = first_six.iter().filter(|n| n.starts_with('b')).count();
    assert_eq!(big, 4, "{first_six:?}");
    // A namespace that holds slices already waits behind one that holds none.
    let shares = BTreeMap::from([
        (
            "big".to_string(),
            Share {
                weight: 2.0,
                holding: 10,
                usage: 0.0,
            },
        ),
        (
            "small".to_string(),
            Share {
                weight: 1.0,
                ..Default::default()
            },
        ),
    ]);
    assert!(
        names(&pods, &order(SchedulingPolicy::Fair, &pods, &shares))[..5]
            .iter()
            .all(|n| n.starts_with('s'))
    );
}

#[test]
fn priority_fair_is_fair_within_a_priority_only() {
    let pods = [
        pod("busy", "busy-high", 100, 3),
        pod("idle", "idle-low", 0, 1),
        pod("busy", "busy-low", 0, 2),
    ];
    let shares = BTreeMap::from([(
        "busy".to_string(),
        Share {
            weight: 1.0,
            holding: 5,
            usage: 0.0,
        },
    )]);
    assert_eq!(
        names(
            &pods,
            &order(SchedulingPolicy::PriorityFair, &pods, &shares)
        ),
        ["busy-high", "idle-low", "busy-low"]
    );
}

struct First;
impl Placer for First {
    fn pick(
        &mut self,
        _: &Waiting,
        candidates: &BTreeMap<String, Vec<FreeDevice>>,
        _: &[FreeDevice],
        _: &Nodes,
    ) -> String {
        candidates.keys().next().unwrap().clone()
    }
}

fn device(node: &str, gpu: u32, name: &str, gib: u64) -> FreeDevice {
    FreeDevice {
        node: node.into(),
        gpu,
        device: name.into(),
        memory_bytes: gib << 30,
        compute: 25,
        share: 250,
        recut_at: None,
        nvlink_domain: None,
    }
}

#[test]
fn a_pod_of_several_slices_gets_all_of_them_on_one_node_or_waits() {
    let gpu = |node: &str, i: u32, domain: Option<&str>| FreeDevice {
        share: 1000,
        nvlink_domain: domain.map(str::to_string),
        ..device(node, i, &format!("{node}-gpu{i}"), 80)
    };
    let needs = BTreeMap::from([(
        "trainer".to_string(),
        Need {
            memory_bytes: 70 << 30,
            compute: 0,
        },
    )]);
    let ask = |name: &str, count: u32, nvlink: bool| Waiting {
        policy: "trainer".into(),
        count,
        nvlink,
        ..pod("ml", name, 0, 0)
    };
    // Three free on one board, two on another: a 4-GPU pod takes none of them.
    let three_and_two: Vec<FreeDevice> = (0..3)
        .map(|i| gpu("hgx-a", i, Some("A")))
        .chain((0..2).map(|i| gpu("hgx-b", i, Some("B"))))
        .collect();
    let pods = [ask("four", 4, false), ask("two", 2, false)];
    let d = decide(
        &pods,
        &[0, 1],
        &needs,
        &three_and_two,
        &mut Nodes::default(),
        &mut EnginePlacer::default(),
    );
    assert_eq!(d.wait, [("ml/four".to_string(), 1, Reason::NoSliceFits)]);
    // The 2-GPU pod behind it goes, onto the node where two are free (the fewest that hold
    // it), so the three stay together.
    assert_eq!(d.admit, [("ml/two".to_string(), "hgx-b".to_string())]);

    // A fourth frees up on the first board: the 4-GPU pod takes all four, and nothing is
    // left there for the next one.
    let mut four = three_and_two.clone();
    four.push(gpu("hgx-a", 3, Some("A")));
    let pods = [ask("four", 4, false), ask("another", 4, false)];
    let d = decide(
        &pods,
        &[0, 1],
        &needs,
        &four,
        &mut Nodes::default(),
        &mut First,
    );
    assert_eq!(d.admit, [("ml/four".to_string(), "hgx-a".to_string())]);
    assert_eq!(d.wait, [("ml/another".to_string(), 1, Reason::NoSliceFits)]);

    // NVLink: a PCIe pair (no domain) and a pair split over two domains never serve; a
    // pair on one domain does.
    let pcie = [gpu("pcie", 0, None), gpu("pcie", 1, None)];
    let split = [
        gpu("two-islands", 0, Some("X")),
        gpu("two-islands", 4, Some("Y")),
    ];
    let pods = [ask("pair", 2, true)];
    for free in [&pcie[..], &split[..]] {
        let d = decide(&pods, &[0], &needs, free, &mut Nodes::default(), &mut First);
        assert_eq!(d.wait, [("ml/pair".to_string(), 1, Reason::NoSliceFits)]);
    }
    let d = decide(
        &[ask("pair", 2, false)],
        &[0],
        &needs,
        &pcie,
        &mut Nodes::default(),
        &mut First,
    );
    assert_eq!(d.admit, [("ml/pair".to_string(), "pcie".to_string())]);
    let joined: Vec<FreeDevice> = split
        .iter()
        .cloned()
        .chain([gpu("two-islands", 5, Some("Y"))])
        .collect();
    let d = decide(
        &pods,
        &[0],
        &needs,
        &joined,
        &mut Nodes::default(),
        &mut First,
    );
    assert_eq!(
        d.admit,
        [("ml/pair".to_string(), "two-islands".to_string())]
    );
}

#[test]
fn a_pod_that_would_outlive_a_slice_is_not_put_on_it() {
    let recut_soon = FreeDevice {
        recut_at: Some(at(1800)),
        ..device("a", 0, "a-0", 20)
    };
    let steady = device("b", 0, "b-0", 20);
    let needs = BTreeMap::from([(
        "notebook".to_string(),
        Need {
            memory_bytes: 8 << 30,
            compute: 0,
        },
    )]);
    let long = Waiting {
        runs_until: Some(at(7200)),
        ..pod("ns", "long", 0, 0)
    };
    let short = Waiting {
        runs_until: Some(at(600)),
        ..pod("ns", "short", 0, 1)
    };
    // Only the slice that is re-cut soon is free: the long job waits, the short one goes.
    let pods = [long.clone(), short.clone()];
    let d = decide(
        &pods,
        &[0, 1],
        &needs,
        std::slice::from_ref(&recut_soon),
        &mut Nodes::default(),
        &mut First,
    );
    assert_eq!(d.admit, [("ns/short".to_string(), "a".to_string())]);
    assert_eq!(
        d.wait,
        [("ns/long".to_string(), 1, Reason::WindowChangeAhead)]
    );
    // With a steady slice too, the long job takes that one.
    let d = decide(
        &pods,
        &[0, 1],
        &needs,
        &[recut_soon, steady],
        &mut Nodes::default(),
        &mut First,
    );
    assert_eq!(
        d.admit,
        [
            ("ns/long".to_string(), "b".to_string()),
            ("ns/short".to_string(), "a".to_string())
        ]
    );
}

#[test]
fn pods_are_admitted_while_devices_fit_and_the_rest_wait_in_order() {
    let mut pods = vec![
        pod("a", "big", 100, 1),
        pod("a", "small-1", 0, 2),
        pod("a", "small-2", 0, 3),
    ];
    pods[0].policy = "training".into();
    let needs = BTreeMap::from([
        (
            "notebook".to_string(),
            Need {
                memory_bytes: 9 << 30,
                compute: 0,
            },
        ),
        (
            "training".to_string(),
            Need {
                memory_bytes: 40 << 30,
                compute: 0,
            },
        ),
    ]);
    let free = [device("n1", 0, "gpu0-s0", 20)];
    let order = order(SchedulingPolicy::Priority, &pods, &BTreeMap::new());
    let decision = decide(
        &pods,
        &order,
        &needs,
        &free,
        &mut Nodes::default(),
        &mut First,
    );
    // The big one fits no free device: it waits first in line; a small one takes the
    // device (the big one could not use it); the other small one waits behind it.
    assert_eq!(
        decision.admit,
        [("a/small-1".to_string(), "n1".to_string())]
    );
    assert_eq!(
        decision.wait,
        [
            ("a/big".to_string(), 1, Reason::NoSliceFits),
            ("a/small-2".to_string(), 2, Reason::NoSliceFits)
        ]
    );
}

#[test]
fn fragmentation_is_the_free_memory_the_expected_policies_cannot_use() {
    let free = [
        device("a", 0, "s1", 10),
        device("a", 0, "s2", 10),
        device("b", 0, "s1", 20),
    ];
    let gib = |n: u64| n << 30;
    let big = Need {
        memory_bytes: gib(18),
        compute: 0,
    };
    let small = Need {
        memory_bytes: gib(8),
        compute: 0,
    };
    // 18 GiB cannot use the two 10 GiB slices (half the free memory); 8 GiB uses all.
    assert_eq!(fragmentation(&free, &[(big, 1.0), (small, 1.0)]), 25.0);
    assert_eq!(fragmentation(&free, &[(big, 3.0), (small, 1.0)]), 37.5);
    assert_eq!(fragmentation(&free, &[(small, 1.0)]), 0.0);
    assert_eq!(fragmentation(&[], &[(big, 1.0)]), 0.0);
    assert_eq!(fragmentation(&free, &[]), 0.0);
}

/// The node `EnginePlacer` picks for `pod` among `free` (all fitting).
fn engine_pick(pod: &Waiting, free: &[FreeDevice], nodes: &Nodes) -> String {
    let mut candidates: BTreeMap<String, Vec<FreeDevice>> = BTreeMap::new();
    for d in free {
        candidates
            .entry(d.node.clone())
            .or_default()
            .push(d.clone());
    }
    EnginePlacer::default().pick(pod, &candidates, free, nodes)
}

/// Nodes with these many GPUs of the pool each, and no room limit.
fn gpus_on(nodes: &[(&str, u32)]) -> Nodes {
    Nodes {
        gpus: nodes.iter().map(|(n, g)| (n.to_string(), *g)).collect(),
        ..Nodes::default()
    }
}

#[test]
fn the_engine_packs_shares_onto_the_fuller_node() {
    // n1 has one free slice left of four on its GPU, n2 a whole free GPU: the engine keeps
    // n2's GPU whole.
    let free: Vec<FreeDevice> = std::iter::once(device("n1", 0, "gpu0-s3", 20))
        .chain((0..4).map(|s| device("n2", 0, &format!("gpu0-s{s}"), 20)))
        .collect();
    let nodes = gpus_on(&[("n1", 1), ("n2", 1)]);
    assert_eq!(engine_pick(&pod("a", "p", 0, 0), &free, &nodes), "n1");
}

#[test]
fn the_engine_takes_the_mig_instance_that_wastes_least_and_keeps_whole_gpus_whole() {
    // A 1g-sized pod: n1 offers only a 3g instance (half its GPU), n2 a 1g (an eighth).
    let instance = |node: &str, name: &str, gib: u64, share: u32| FreeDevice {
        share,
        ..device(node, 0, name, gib)
    };
    let free = [
        instance("n1", "gpu0-mig0-3g.40gb", 40, 500),
        instance("n2", "gpu0-mig6-1g.10gb", 10, 125),
    ];
    let nodes = gpus_on(&[("n1", 1), ("n2", 1)]);
    assert_eq!(engine_pick(&pod("a", "p", 0, 0), &free, &nodes), "n2");

    // Whole GPUs: one left free on n1 (of 8), all 8 free on n2; a one-GPU pod goes to n1, so
    // n2 stays whole for an eight-GPU pod.
    let whole = |node: &str, gpu: u32| FreeDevice {
        share: 1000,
        ..device(node, gpu, &format!("{node}-gpu{gpu}"), 80)
    };
    let free: Vec<FreeDevice> = std::iter::once(whole("n1", 7))
        .chain((0..8).map(|g| whole("n2", g)))
        .collect();
    let nodes = gpus_on(&[("n1", 8), ("n2", 8)]);
    assert_eq!(engine_pick(&pod("a", "p", 0, 0), &free, &nodes), "n1");
}

#[test]
fn a_node_without_the_cpu_or_memory_a_pod_requests_is_not_given_it() {
    let needs = BTreeMap::from([(
        "notebook".to_string(),
        Need {
            memory_bytes: 16 << 30,
            compute: 0,
        },
    )]);
    // n1 is the fuller node (the engine's choice on GPUs alone), but 2 of its 8 cores are left.
    let free: Vec<FreeDevice> = std::iter::once(device("n1", 0, "gpu0-s3", 20))
        .chain((0..4).map(|s| device("n2", 0, &format!("gpu0-s{s}"), 20)))
        .collect();
    let room = |cpu_free: u64| Room {
        cpu_free_milli: cpu_free,
        ..Room::empty(8000, 64 << 10)
    };
    let mut nodes = Nodes {
        rooms: BTreeMap::from([("n1".into(), room(2000)), ("n2".into(), room(8000))]),
        gpus: BTreeMap::from([("n1".into(), 1), ("n2".into(), 1)]),
    };
    let asking = |name: &str, cpu_milli: u64| Waiting {
        cpu_milli,
        memory_mib: 1024,
        ..pod("a", name, 0, 0)
    };
    let pods = [asking("big", 4000), asking("small", 1000)];
    let d = decide(
        &pods,
        &[0, 1],
        &needs,
        &free,
        &mut nodes,
        &mut EnginePlacer::default(),
    );
    assert_eq!(
        d.admit,
        [
            ("a/big".to_string(), "n2".to_string()),
            ("a/small".to_string(), "n1".to_string())
        ]
    );
    // What they take leaves the nodes' rooms: n2 has 4 cores left, n1 one.
    assert_eq!(nodes.rooms["n2"].cpu_free_milli, 4000);
    assert_eq!(nodes.rooms["n1"].cpu_free_milli, 1000);
    assert_eq!(nodes.rooms["n1"].memory_free_mib, (64 << 10) - 1024);

    // Slices fit but no node has the room: it waits, and says why.
    let d = decide(
        &[asking("huge", 9000)],
        &[0],
        &needs,
        &free,
        &mut nodes,
        &mut EnginePlacer::default(),
    );
    assert_eq!(d.wait, [("a/huge".to_string(), 1, Reason::NoRoom)]);
    assert!(d.admit.is_empty());
}

#[test]
fn usage_decays_by_half_each_half_life() {
    let after = decay(100.0, 0, 3600.0, 3600.0);
    assert!((after - 50.0).abs() < 1e-9);
    assert!((decay(0.0, 2, 10.0, 3600.0) - 20.0).abs() < 1e-9);
}

fn running(claim: &str, namespace: &str, priority: i64, loss: f64) -> Running {
    Running {
        claim: format!("{namespace}/{claim}"),
        namespace: namespace.into(),
        device: FreeDevice {
            node: "n".into(),
            gpu: 0,
            device: claim.into(),
            memory_bytes: 20 << 30,
            compute: 100,
            share: 250,
            recut_at: None,
            nvlink_domain: None,
        },
        priority,
        preemptible: true,
        loss_seconds: loss,
        max_loss_seconds: None,
        taken_for: None,
    }
}

fn need() -> BTreeMap<String, Need> {
    [(
        "notebook".to_string(),
        Need {
            memory_bytes: 8 << 30,
            compute: 0,
        },
    )]
    .into()
}

#[test]
fn a_pod_of_several_slices_takes_back_the_fewest_that_complete_it_on_one_node() {
    let on = |node: &str, domain: Option<&str>, claim: &str, loss: f64| Running {
        device: FreeDevice {
            node: node.into(),
            nvlink_domain: domain.map(str::to_string),
            ..running(claim, "ml", 0, loss).device
        },
        ..running(claim, "ml", 0, loss)
    };
    let free_on = |node: &str, domain: Option<&str>, name: &str| FreeDevice {
        node: node.into(),
        device: name.into(),
        nvlink_domain: domain.map(str::to_string),
        ..running(name, "ml", 0, 0.0).device
    };
    let quad = Waiting {
        count: 4,
        ..pod("ml", "quad", 1000, 5)
    };
    // Board a: two free, two running (one cheap, one dear); board b: none free, four cheap.
    let candidates = [
        on("a", None, "a-cheap", 10.0),
        on("a", None, "a-dear", 900.0),
        on("b", None, "b-1", 1.0),
        on("b", None, "b-2", 1.0),
        on("b", None, "b-3", 1.0),
        on("b", None, "b-4", 1.0),
    ];
    let free = [
        free_on("a", None, "a-free-1"),
        free_on("a", None, "a-free-2"),
    ];
    let shares = BTreeMap::new();
    let claims = |got: Vec<Preempt>| -> Vec<String> {
        got.into_iter()
            .map(|p| format!("{} for {}", p.claim, p.for_pod))
            .collect()
    };
    // Two victims beside two free ones beat four cheaper ones: every victim on one node.
    assert_eq!(
        claims(preempt(
            SchedulingPolicy::PriorityFair,
            &[&quad],
            &need(),
            &free,
            &candidates,
            &shares,
        )),
        ["ml/a-cheap for ml/quad", "ml/a-dear for ml/quad"]
    );
    // Nowhere enough: nobody is taken back for nothing.
    let seven = Waiting {
        count: 7,
        ..quad.clone()
    };
    assert!(
        preempt(
            SchedulingPolicy::PriorityFair,
            &[&seven],
            &need(),
            &free,
            &candidates,
            &shares
        )
        .is_empty()
    );
    // NVLink: victims off the pod's domain do not count.
    let nvquad = Waiting {
        nvlink: true,
        ..quad.clone()
    };
    let split = [
        on("c", Some("X"), "c-x", 1.0),
        on("c", Some("Y"), "c-y1", 1.0),
        on("c", Some("Y"), "c-y2", 1.0),
    ];
    let free = [
        free_on("c", Some("X"), "c-x-free"),
        free_on("c", Some("Y"), "c-y-free1"),
        free_on("c", Some("Y"), "c-y-free2"),
    ];
    assert_eq!(
        claims(preempt(
            SchedulingPolicy::PriorityFair,
            &[&nvquad],
            &need(),
            &free,
            &split,
            &shares,
        )),
        ["ml/c-y1 for ml/quad", "ml/c-y2 for ml/quad"]
    );
}

#[test]
fn a_higher_priority_pod_takes_the_slice_that_loses_the_least_work() {
    let urgent = pod("ml", "urgent", 1000, 5);
    let mut pinned = running("pinned", "ml", 0, 1.0);
    pinned.preemptible = false;
    let candidates = [
        pinned,
        running("fresh-checkpoint", "ml", 0, 30.0),
        running("never-checkpointed", "ml", 0, 600.0),
        running("same-priority", "ml", 1000, 0.0),
    ];
    let shares = BTreeMap::new();
    let got = preempt(
        SchedulingPolicy::PriorityFair,
        &[&urgent],
        &need(),
        &[],
        &candidates,
        &shares,
    );
    assert_eq!(
        got.iter().map(|p| p.claim.as_str()).collect::<Vec<_>>(),
        ["ml/fresh-checkpoint"]
    );
    assert_eq!(got[0].for_pod, "ml/urgent");
    // Fifo preempts nobody; nor does anyone for a pod of equal priority in one namespace.
    assert!(
        preempt(
            SchedulingPolicy::Fifo,
            &[&urgent],
            &need(),
            &[],
            &candidates,
            &shares
        )
        .is_empty()
    );
    let peer = pod("ml", "peer", 0, 6);
    assert!(
        preempt(
            SchedulingPolicy::PriorityFair,
            &[&peer],
            &need(),
            &[],
            &candidates,
            &shares
        )
        .is_empty()
    );
}

#[test]
fn a_victim_within_its_max_loss_goes_before_one_past_its_own() {
    // `strict` would lose 15 min against a maxLoss of 10; `relaxed` 20 min against 30: the
    // least loss alone would take `strict`, past what its CheckpointPolicy allows.
    let urgent = pod("ml", "urgent", 1000, 5);
    let mut strict = running("strict", "ml", 0, 900.0);
    strict.max_loss_seconds = Some(600.0);
    let mut relaxed = running("relaxed", "ml", 0, 1200.0);
    relaxed.max_loss_seconds = Some(1800.0);
    let take = |candidates: &[Running]| {
        preempt(
            SchedulingPolicy::PriorityFair,
            &[&urgent],
            &need(),
            &[],
            candidates,
            &BTreeMap::new(),
        )
        .into_iter()
        .map(|p| p.claim)
        .collect::<Vec<_>>()
    };
    assert_eq!(take(&[strict.clone(), relaxed]), ["ml/relaxed"]);
    // When every victim is past its maxLoss, the least loss still decides.
    let mut over = running("over", "ml", 0, 1200.0);
    over.max_loss_seconds = Some(600.0);
    assert_eq!(take(&[strict, over]), ["ml/strict"]);
}

#[test]
fn a_preemption_under_way_is_kept_while_its_pod_waits_and_never_doubled() {
    let urgent = pod("ml", "urgent", 1000, 5);
    let mut taken = running("a", "ml", 0, 600.0);
    taken.taken_for = Some(("ml/urgent".into(), "priority".into()));
    let candidates = [taken, running("b", "ml", 0, 1.0)];
    let shares = BTreeMap::new();
    let got = preempt(
        SchedulingPolicy::Priority,
        &[&urgent],
        &need(),
        &[],
        &candidates,
        &shares,
    );
    assert_eq!(
        got.iter()
            .map(|p| (p.claim.as_str(), p.reason.as_str()))
            .collect::<Vec<_>>(),
        [("ml/a", "priority")]
    );
    // Its pod no longer waits (it was admitted, or deleted): the preemption is dropped.
    assert!(
        preempt(
            SchedulingPolicy::Priority,
            &[],
            &need(),
            &[],
            &candidates,
            &shares
        )
        .is_empty()
    );
}

#[test]
fn fair_share_preemption_converges_to_the_weights() {
    // Six slices, all held by namespace b (weight 1); namespace a (weight 2) waits.
    let shares_of = |a: u32, b: u32| -> BTreeMap<String, Share> {
        [
            (
                "a".to_string(),
                Share {
                    weight: 2.0,
                    holding: a,
                    usage: 0.0,
                },
            ),
            (
                "b".to_string(),
                Share {
                    weight: 1.0,
                    holding: b,
                    usage: 0.0,
                },
            ),
        ]
        .into()
    };
    let (mut a, mut b) = (0u32, 6u32);
    for round in 0..10 {
        let waiting = pod("a", &format!("a-{round}"), 0, round);
        let victims: Vec<Running> = (0..b)
            .map(|i| running(&format!("b{i}"), "b", 0, 1.0))
            .collect();
        let got = preempt(
            SchedulingPolicy::PriorityFair,
            &[&waiting],
            &need(),
            &[],
            &victims,
            &shares_of(a, b),
        );
        if got.is_empty() {
            break;
        }
        a += 1;
        b -= 1;
    }
    assert_eq!((a, b), (4, 2), "2:1");
}

#[test]
fn a_window_raises_a_policys_priority_while_it_is_open() {
    let pool: gpuslice_api::GpuPool = serde_yaml::from_str(
        "
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: shared-a100}
spec:
  nodeSelector: {}
  layout: {software: {slices: 4, memory: 20Gi, compute: 25}}
  windows:
  - name: night
    timeZone: Asia/Shanghai
    start: '20:00'
    end: '08:00'
    layout: {software: {slices: 2, memory: 40Gi, compute: 50}}
    priorities: {bert-finetune: high}
",
    )
    .unwrap();
    let day: DateTime<Utc> = "2026-12-02T04:00:00Z".parse().unwrap();
    let night: DateTime<Utc> = "2026-12-02T14:00:00Z".parse().unwrap();
    let classes: BTreeMap<String, i64> = [("batch-critical".to_string(), 5000)].into();
    let at = |policy: &str, declared: &str, when| {
        priority_in_force(&pool, policy, declared, when, &classes)
    };
    assert_eq!(at("bert-finetune", "normal", day), 100);
    assert_eq!(at("bert-finetune", "normal", night), 1000);
    assert_eq!(at("notebook", "low", night), 0);
    // A PriorityClass name stands for its value; one that does not exist for normal.
    assert_eq!(at("etl", "batch-critical", day), 5000);
    assert_eq!(at("etl", "no-such-class", day), 100);
}

#[test]
fn a_replay_cycles_the_arrivals_and_reads_the_unallocated_share_at_each_mark() {
    use super::replay::{Arrival, Pool, replay};
    // Two nodes, one GPU each in four slices; n1 has room for two 4-core pods only.
    let devices: Vec<FreeDevice> = ["n1", "n2"]
        .iter()
        .flat_map(|n| (0..4).map(move |s| device(n, 0, &format!("gpu0-s{s}"), 20)))
        .collect();
    let pools = BTreeMap::from([(
        "shared".to_string(),
        Pool {
            devices,
            needs: BTreeMap::from([(
                "notebook".to_string(),
                Need {
                    memory_bytes: 16 << 30,
                    compute: 0,
                },
            )]),
        },
    )]);
    let rooms = BTreeMap::from([
        ("n1".to_string(), Room::empty(8000, 1 << 20)),
        ("n2".to_string(), Room::empty(64000, 1 << 20)),
    ]);
    let arrival = Arrival {
        pool: "shared".into(),
        pod: Waiting {
            cpu_milli: 4000,
            ..pod("a", "p", 0, 0)
        },
        demand: 250,
    };
    let r = replay(
        &pools,
        rooms,
        &[arrival],
        &mut EnginePlacer::default(),
        &[50.0, 100.0],
    );
    // Four arrive by the first mark (half the GPUs asked for), eight by the second; n1 takes
    // two (its CPU), n2 four: six of eight slices.
    assert_eq!(r.arrived, 8);
    assert_eq!(r.placed, 6);
    assert_eq!(r.unallocated.len(), 2);
    assert!(
        (r.unallocated[0] - 50.0).abs() < 1e-9,
        "{:?}",
        r.unallocated
    );
    assert!(
        (r.unallocated[1] - 25.0).abs() < 1e-9,
        "{:?}",
        r.unallocated
    );
}
