//! Which node a pod goes to: the placement engine's own scoring ([`placement::Policy`], ours
//! being [`policies::Mix`], the policy `gpuslice bench placement` measures against FGD) over
//! what the queue reads from the cluster, for every layout.
//!
//! Each candidate node is shown to the policy as the engine's [`placement::Node`]: its
//! allocatable CPU and memory and what the pods on it leave free ([`Room`]), and each of the
//! pool's GPUs on it as the thousandths still free (the [`FreeDevice::share`]s of its free
//! devices: a software slice, a MIG instance by its memory, a whole GPU). The pod is a
//! [`Request`] of its CPU and memory requests and the GPU share of the devices it takes: the
//! ones kube-scheduler's allocator is given on that node ([`taken_on`]). The offline replay
//! ([`super::replay`]) builds the same inputs from a trace and calls the same code.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, HashSet};

use crate::placement::{self, Choice, Gpu, GpuAsk, Policy, Request, WHOLE, policies};

use super::{FreeDevice, Waiting, taken_on};

/// Scores closer than this are equal.
const TIE: f64 = 1e-9;

/// How many pods the placer remembers having shown the policy (it learns each arrival once).
const REMEMBERED: usize = 100_000;

/// A node's CPU (millicores) and memory (MiB): allocatable, and what the pods on it (and those
/// the queue sent to it that are not bound yet) leave free.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Room {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub cpu_free_milli: u64,
    pub memory_free_mib: u64,
}

impl Room {
    /// A node with nothing on it.
    pub fn empty(cpu_milli: u64, memory_mib: u64) -> Room {
        Room {
            cpu_milli,
            memory_mib,
            cpu_free_milli: cpu_milli,
            memory_free_mib: memory_mib,
        }
    }

    pub fn fits(&self, pod: &Waiting) -> bool {
        self.cpu_free_milli >= pod.cpu_milli && self.memory_free_mib >= pod.memory_mib
    }

    /// `pod` goes on the node.
    pub fn take(&mut self, pod: &Waiting) {
        self.cpu_free_milli = self.cpu_free_milli.saturating_sub(pod.cpu_milli);
        self.memory_free_mib = self.memory_free_mib.saturating_sub(pod.memory_mib);
    }
}

/// The nodes as one pass sees them: their [`Room`] (shared by every pool on them, so a pool's
/// admissions leave less for the next pool's) and how many of the pool's GPUs each has (free
/// or not). A node without a room is not limited by CPU or memory (its Node states no
/// allocatable resources).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Nodes {
    pub rooms: BTreeMap<String, Room>,
    /// Per node, the pool's GPUs on it.
    pub gpus: BTreeMap<String, u32>,
}

impl Nodes {
    pub fn fits(&self, node: &str, pod: &Waiting) -> bool {
        self.rooms.get(node).is_none_or(|r| r.fits(pod))
    }
}

/// Picks the node for a pod among the nodes whose free devices hold it.
pub trait Placer {
    /// `pod` is at the gate and these free devices of the pool fit it (per node; before its
    /// nodes' rooms are checked): a learning policy is shown each such pod once, whether it
    /// goes or waits for room (one that no free device fits has no share to learn yet).
    fn arrived(&mut self, pod: &Waiting, fitting: &BTreeMap<String, Vec<FreeDevice>>) {
        let _ = (pod, fitting);
    }

    /// `candidates`: per node, the free devices that fit the pod (at least its `count`, on one
    /// NVLink domain where it needs one), on nodes with room for its CPU and memory; `free`:
    /// every free device of the pool.
    fn pick(
        &mut self,
        pod: &Waiting,
        candidates: &BTreeMap<String, Vec<FreeDevice>>,
        free: &[FreeDevice],
        nodes: &Nodes,
    ) -> String;
}

/// The placement engine's policy choosing among the candidate nodes (by default ours,
/// [`policies::Mix`], which learns the mix of arrivals: each pod is shown to it once).
pub struct EnginePlacer {
    policy: Box<dyn Policy + Send>,
    shown: HashSet<String>,
}

impl Default for EnginePlacer {
    fn default() -> Self {
        EnginePlacer::new(Box::new(policies::Mix::default()))
    }
}

impl EnginePlacer {
    pub fn new(policy: Box<dyn Policy + Send>) -> EnginePlacer {
        EnginePlacer {
            policy,
            shown: HashSet::new(),
        }
    }

    pub fn policy_name(&self) -> &str {
        self.policy.name()
    }
}

/// The GPU thousandths a device is of its GPU (at least 1, at most a whole GPU).
fn share_of(d: &FreeDevice) -> u32 {
    d.share.clamp(1, WHOLE)
}

/// The pod as the engine's request: its CPU and memory, and of GPUs whole ones when every
/// device it could take is a whole GPU, else the share of the smallest of them (per slice: the
/// engine's shares are of one GPU; a pod of several slices is scored by the GPUs it takes).
fn request_of(pod: &Waiting, candidates: &BTreeMap<String, Vec<FreeDevice>>) -> Request {
    let smallest = candidates
        .values()
        .flatten()
        .map(share_of)
        .min()
        .unwrap_or(WHOLE);
    Request {
        cpu_milli: pod.cpu_milli,
        memory_mib: pod.memory_mib,
        gpu: if smallest >= WHOLE {
            GpuAsk::Whole(pod.count.max(1))
        } else {
            GpuAsk::Share(smallest)
        },
        models: Vec::new(),
    }
}

/// The GPU thousandths a pod of `count` slices, as `request`, needs at least.
fn asked(request: &Request, count: u32) -> u32 {
    match request.gpu {
        GpuAsk::Share(milli) => milli * count.max(1),
        GpuAsk::Whole(n) => n * WHOLE,
        GpuAsk::None | GpuAsk::Mig(_) => 0,
    }
}

/// `node` as the engine sees it, and the choice of the devices the pod would take there.
fn engine_view(
    node: &str,
    taken: &[FreeDevice],
    free: &[&FreeDevice],
    nodes: &Nodes,
) -> (placement::Node, Choice) {
    let mut free_by_gpu: BTreeMap<u32, u32> = BTreeMap::new();
    for d in free {
        let f = free_by_gpu.entry(d.gpu).or_default();
        *f = (*f + share_of(d)).min(WHOLE);
    }
    let position: HashMap<u32, usize> = free_by_gpu
        .keys()
        .enumerate()
        .map(|(i, g)| (*g, i))
        .collect();
    let mut gpus: Vec<Gpu> = free_by_gpu
        .values()
        .map(|&free| Gpu::Shared { free })
        .collect();
    // The pool's GPUs with nothing free count too (a node's share of free GPU is over all).
    let all = nodes.gpus.get(node).copied().unwrap_or(0) as usize;
    gpus.resize(all.max(gpus.len()), Gpu::Shared { free: 0 });
    let unlimited = u64::MAX / 4;
    let room = nodes.rooms.get(node).copied().unwrap_or(Room {
        cpu_milli: unlimited,
        memory_mib: unlimited,
        cpu_free_milli: unlimited,
        memory_free_mib: unlimited,
    });
    let mut choice = Choice {
        node: 0,
        gpus: Vec::new(),
        mig: None,
    };
    for d in taken {
        // Taken devices are among the node's free ones, so their GPU has a position.
        let Some(&at) = position.get(&d.gpu) else {
            continue;
        };
        match choice.gpus.iter_mut().find(|(g, _)| *g == at) {
            Some((_, milli)) => *milli += share_of(d),
            None => choice.gpus.push((at, share_of(d))),
        }
    }
    for (g, milli) in &mut choice.gpus {
        *milli = (*milli).min(gpus[*g].free_milli());
    }
    let view = placement::Node {
        // Nameless: the policy's caches key on the node's state, not its name.
        name: String::new(),
        model: String::new(),
        cpu_total: room.cpu_milli,
        memory_total: room.memory_mib,
        cpu_free: room.cpu_free_milli,
        memory_free: room.memory_free_mib,
        gpus,
    };
    (view, choice)
}

impl Placer for EnginePlacer {
    fn arrived(&mut self, pod: &Waiting, fitting: &BTreeMap<String, Vec<FreeDevice>>) {
        if self.shown.len() >= REMEMBERED {
            self.shown.clear();
        }
        if self.shown.insert(pod.key()) {
            self.policy.observe(&request_of(pod, fitting));
        }
    }

    fn pick(
        &mut self,
        pod: &Waiting,
        candidates: &BTreeMap<String, Vec<FreeDevice>>,
        free: &[FreeDevice],
        nodes: &Nodes,
    ) -> String {
        let request = request_of(pod, candidates);
        let total: u64 = free.iter().map(|d| u64::from(share_of(d))).sum();
        self.policy
            .survey(&BTreeMap::from([(String::new(), total)]));
        let mut free_on: HashMap<&str, Vec<&FreeDevice>> = HashMap::new();
        for d in free {
            free_on.entry(d.node.as_str()).or_default().push(d);
        }
        // Nodes in the same state score the same: each state is scored once, for the first
        // of its nodes by name (ties go to the node with the fewest fitting devices, then the
        // first by name, so whole nodes stay free).
        let mut scored: HashMap<(placement::Node, Vec<(usize, u32)>), f64> = HashMap::new();
        let mut best: Option<(f64, usize, &String)> = None;
        for (name, devices) in candidates {
            let usable: Vec<&FreeDevice> = devices.iter().collect();
            let taken = taken_on(pod.count, pod.nvlink, &usable);
            if taken.is_empty() {
                continue;
            }
            let on_node = free_on.get(name.as_str()).map_or(&[][..], Vec::as_slice);
            let (view, choice) = engine_view(name, &taken, on_node, nodes);
            if !self.policy.cacheable() {
                // Scores that are drawn (Random) are drawn per node, not per state.
                scored.clear();
            }
            let score = match scored.entry((view, choice.gpus)) {
                Entry::Occupied(known) => *known.get(),
                Entry::Vacant(state) => {
                    let (view, gpus) = state.key();
                    let choice = Choice {
                        node: 0,
                        gpus: gpus.clone(),
                        mig: None,
                    };
                    // A device larger than the pod needs (a 3g instance for a 1g pod) loses
                    // the difference for as long as the pod runs: a certain loss, counted in
                    // the unit of the policy's packing loss (millionths of a GPU).
                    let taken: u32 = gpus.iter().map(|(_, milli)| milli).sum();
                    let waste = taken.saturating_sub(asked(&request, pod.count));
                    let s = self.policy.score(view, &request, &choice) - f64::from(waste) * 1e3;
                    *state.insert(s)
                }
            };
            let better = match best {
                None => true,
                Some((s, fitting, _)) => {
                    score > s + TIE || (score >= s - TIE && devices.len() < fitting)
                }
            };
            if better {
                best = Some((score, devices.len(), name));
            }
        }
        best.map(|(_, _, name)| name.clone())
            .or_else(|| candidates.keys().next().cloned())
            .unwrap_or_default()
    }
}
