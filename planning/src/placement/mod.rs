//! The placement engine: given a cluster's free capacity and a request, choose the node and
//! GPU(s), or say why nothing fits. Pure code over plain data.
//!
//! The engine enumerates every feasible candidate (a node, and which GPU or GPUs, or which MIG
//! placement) and asks a [`Policy`] to score it; the highest score wins, ties to the lowest node
//! index. Policies are plug-ins (`policies`): Random, DotProd, GpuPacking, BestFit, FGD
//! (fragmentation gradient descent, Weng et al., ATC '23) and ours, [`policies::Mix`].
//!
//! Nodes with identical free capacity are interchangeable, so candidates are scored once per
//! distinct node state ([`Cluster`] keeps nodes grouped by state); that is what makes replaying a
//! whole trace take seconds.

pub mod fragment;
pub mod pack;
pub mod policies;
pub mod replay;

use std::collections::{BTreeMap, BTreeSet};

/// A whole GPU in thousandths.
pub const WHOLE: u32 = 1000;

/// Scores closer than this are equal (sums of weighted fragments differ in the last bits).
const TIE: f64 = 1e-9;

/// What a request asks of GPUs.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GpuAsk {
    None,
    /// A share of one GPU, in thousandths (1–999).
    Share(u32),
    /// Whole GPUs.
    Whole(u32),
    /// One MIG instance of this profile.
    Mig(String),
}

/// A workload to place.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Request {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub gpu: GpuAsk,
    /// GPU models allowed; any when empty.
    pub models: Vec<String>,
}

impl Request {
    /// GPU thousandths the request takes.
    pub fn gpu_milli(&self) -> u64 {
        match &self.gpu {
            GpuAsk::None | GpuAsk::Mig(_) => 0,
            GpuAsk::Share(m) => u64::from(*m),
            GpuAsk::Whole(n) => u64::from(*n) * u64::from(WHOLE),
        }
    }

    pub fn allows(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m == model)
    }
}

/// One GPU's free capacity.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Gpu {
    /// Shared by fractions: thousandths free.
    Shared { free: u32 },
    /// In MIG mode: memory slices taken (bit mask) and compute slices taken.
    Mig { occupied: u32, compute_used: u32 },
}

impl Gpu {
    /// Thousandths free, for scoring (a MIG GPU counts by free memory slices of 8).
    pub fn free_milli(&self) -> u32 {
        match self {
            Gpu::Shared { free } => *free,
            Gpu::Mig { occupied, .. } => (8 - occupied.count_ones().min(8)) * WHOLE / 8,
        }
    }
}

/// One node's free capacity.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Node {
    pub name: String,
    pub model: String,
    pub cpu_total: u64,
    pub memory_total: u64,
    pub cpu_free: u64,
    pub memory_free: u64,
    pub gpus: Vec<Gpu>,
}

impl Node {
    /// A node with nothing allocated.
    pub fn empty(name: &str, model: &str, cpu_milli: u64, memory_mib: u64, gpus: u32) -> Node {
        Node {
            name: name.to_string(),
            model: model.to_string(),
            cpu_total: cpu_milli,
            memory_total: memory_mib,
            cpu_free: cpu_milli,
            memory_free: memory_mib,
            gpus: vec![Gpu::Shared { free: WHOLE }; gpus as usize],
        }
    }

    pub fn gpu_free(&self) -> u64 {
        self.gpus.iter().map(|g| u64::from(g.free_milli())).sum()
    }

    /// What makes two nodes interchangeable for placement.
    fn state(&self) -> State {
        let mut gpus = self.gpus.clone();
        gpus.sort();
        State {
            model: self.model.clone(),
            cpu_free: self.cpu_free,
            memory_free: self.memory_free,
            cpu_total: self.cpu_total,
            memory_total: self.memory_total,
            gpus,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct State {
    model: String,
    cpu_free: u64,
    memory_free: u64,
    cpu_total: u64,
    memory_total: u64,
    gpus: Vec<Gpu>,
}

/// Where a request goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    pub node: usize,
    /// GPU index → thousandths taken on it.
    pub gpus: Vec<(usize, u32)>,
    /// For a MIG request: the GPU and the first memory slice of the instance.
    pub mig: Option<(usize, u32)>,
}

/// Why nothing fits.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoFit {
    #[error("no node has an allowed GPU model ({0})")]
    Model(String),
    #[error("no node with an allowed GPU has {cpu_milli}m CPU and {memory_mib} MiB memory free")]
    CpuMemory { cpu_milli: u64, memory_mib: u64 },
    #[error("no node has the GPU capacity asked for ({0:?})")]
    Gpu(GpuAsk),
}

/// The cluster as the engine sees it.
#[derive(Clone, Debug)]
pub struct Cluster {
    pub nodes: Vec<Node>,
    groups: BTreeMap<State, BTreeSet<usize>>,
    /// Free GPU thousandths per GPU model.
    free_by_model: BTreeMap<String, u64>,
}

/// A placement policy: scores feasible candidates; higher is better.
pub trait Policy {
    fn name(&self) -> &str;
    /// Called once per request before any scoring (learning policies watch arrivals here).
    fn observe(&mut self, _request: &Request) {}
    /// Called before each choice with the free GPU thousandths of each GPU model, for policies
    /// that weigh where capacity is scarce.
    fn survey(&mut self, _free_by_model: &BTreeMap<String, u64>) {}
    /// The score of `choice` for `request` on `node` (the node as it is before the placement).
    fn score(&mut self, node: &Node, request: &Request, choice: &Choice) -> f64;
    /// The score of `choice` on a node that has `copies` identical nodes (those in the same
    /// state): the same as on one, except for policies that draw at random per node.
    fn score_copies(
        &mut self,
        node: &Node,
        request: &Request,
        choice: &Choice,
        copies: usize,
    ) -> f64 {
        let _ = copies;
        self.score(node, request, choice)
    }
    /// Among equally good node states, pick one of their nodes (default: the lowest index).
    fn pick(&mut self, nodes: &BTreeSet<usize>) -> usize {
        *nodes.iter().next().expect("groups are never empty")
    }
    /// Whether scores depend only on (node state, request), so they can be cached per state.
    fn cacheable(&self) -> bool {
        true
    }
}

impl Cluster {
    pub fn new(nodes: Vec<Node>) -> Cluster {
        let mut groups: BTreeMap<State, BTreeSet<usize>> = BTreeMap::new();
        let mut free_by_model: BTreeMap<String, u64> = BTreeMap::new();
        for (i, n) in nodes.iter().enumerate() {
            groups.entry(n.state()).or_default().insert(i);
            *free_by_model.entry(n.model.clone()).or_default() += n.gpu_free();
        }
        Cluster {
            nodes,
            groups,
            free_by_model,
        }
    }

    /// Free GPU thousandths per GPU model.
    pub fn free_by_model(&self) -> &BTreeMap<String, u64> {
        &self.free_by_model
    }

    pub fn gpu_total(&self) -> u64 {
        self.nodes
            .iter()
            .map(|n| n.gpus.len() as u64 * u64::from(WHOLE))
            .sum()
    }

    pub fn gpu_free(&self) -> u64 {
        self.nodes.iter().map(Node::gpu_free).sum()
    }

    /// Chooses where `request` goes under `policy`, or why it cannot go anywhere.
    pub fn choose(&self, request: &Request, policy: &mut dyn Policy) -> Result<Choice, NoFit> {
        policy.survey(&self.free_by_model);
        let mut best: Option<(f64, usize, Choice, &BTreeSet<usize>)> = None;
        let mut seen_model = false;
        let mut seen_cpu = false;
        for (state, members) in &self.groups {
            let any = *members.iter().next().expect("groups are never empty");
            let node = &self.nodes[any];
            if request.gpu != GpuAsk::None && !request.allows(&state.model) {
                continue;
            }
            seen_model = true;
            if node.cpu_free < request.cpu_milli || node.memory_free < request.memory_mib {
                continue;
            }
            seen_cpu = true;
            for choice in candidates(node, any, request) {
                let score = policy.score_copies(node, request, &choice, members.len());
                // Scores within rounding of each other tie; ties go to the lowest node index.
                let better = match &best {
                    None => true,
                    Some((s, first, _, _)) => {
                        score > *s + TIE || (score >= *s - TIE && any < *first)
                    }
                };
                if better {
                    best = Some((score, any, choice, members));
                }
            }
        }
        match best {
            Some((_, scored, choice, members)) => {
                let picked = policy.pick(members);
                Ok(same_on(
                    &self.nodes[scored],
                    &self.nodes[picked],
                    picked,
                    &choice,
                ))
            }
            None if !seen_model => Err(NoFit::Model(request.models.join("|"))),
            None if !seen_cpu => Err(NoFit::CpuMemory {
                cpu_milli: request.cpu_milli,
                memory_mib: request.memory_mib,
            }),
            None => Err(NoFit::Gpu(request.gpu.clone())),
        }
    }

    /// Chooses where `request` goes and takes it from that node.
    pub fn place(&mut self, request: &Request, policy: &mut dyn Policy) -> Result<Choice, NoFit> {
        let choice = self.choose(request, policy)?;
        self.allocate(request, &choice);
        Ok(choice)
    }

    /// Takes what `choice` says from its node.
    pub fn allocate(&mut self, request: &Request, choice: &Choice) {
        let node = &mut self.nodes[choice.node];
        let before = node.state();
        let free_before = node.gpu_free();
        node.cpu_free -= request.cpu_milli;
        node.memory_free -= request.memory_mib;
        for &(g, milli) in &choice.gpus {
            if let Gpu::Shared { free } = &mut node.gpus[g] {
                *free -= milli;
            }
        }
        if let (Some((g, start)), GpuAsk::Mig(profile)) = (choice.mig, &request.gpu)
            && let Some(p) = crate::catalog::model(&node.model)
                .ok()
                .and_then(|m| m.profile(profile))
            && let Gpu::Mig {
                occupied,
                compute_used,
            } = &mut node.gpus[g]
        {
            *occupied |= crate::mig::mask(gpuslice_api::Placement {
                start,
                size: p.memory_slices,
            });
            *compute_used += p.compute_slices;
        }
        let after = node.state();
        if let Some(free) = self.free_by_model.get_mut(&node.model) {
            *free = free.saturating_sub(free_before - node.gpu_free());
        }
        if let Some(set) = self.groups.get_mut(&before) {
            set.remove(&choice.node);
            if set.is_empty() {
                self.groups.remove(&before);
            }
        }
        self.groups.entry(after).or_default().insert(choice.node);
    }
}

/// `choice`, made on `scored`, carried over to `target` (a node in the same state, whose GPUs
/// may be in another order): each GPU is replaced by one of the target's in the same state.
fn same_on(scored: &Node, target: &Node, index: usize, choice: &Choice) -> Choice {
    let mut used = vec![false; target.gpus.len()];
    let mut map = |g: usize| -> usize {
        let wanted = &scored.gpus[g];
        let found = (0..target.gpus.len())
            .find(|&t| !used[t] && target.gpus[t] == *wanted)
            .unwrap_or(g);
        if let Some(u) = used.get_mut(found) {
            *u = true;
        }
        found
    };
    let gpus = choice.gpus.iter().map(|&(g, m)| (map(g), m)).collect();
    let mig = choice.mig.map(|(g, start)| (map(g), start));
    Choice {
        node: index,
        gpus,
        mig,
    }
}

/// Every distinct way `request` fits on `node` (its CPU and memory already checked).
pub fn candidates(node: &Node, index: usize, request: &Request) -> Vec<Choice> {
    let choice = |gpus: Vec<(usize, u32)>, mig| Choice {
        node: index,
        gpus,
        mig,
    };
    match &request.gpu {
        GpuAsk::None => vec![choice(Vec::new(), None)],
        GpuAsk::Share(milli) => {
            // GPUs with the same free share are interchangeable: one candidate each.
            let mut seen = Vec::new();
            let mut out = Vec::new();
            for (g, gpu) in node.gpus.iter().enumerate() {
                if let Gpu::Shared { free } = gpu
                    && free >= milli
                    && !seen.contains(free)
                {
                    seen.push(*free);
                    out.push(choice(vec![(g, *milli)], None));
                }
            }
            out
        }
        GpuAsk::Whole(count) => {
            let idle: Vec<usize> = node
                .gpus
                .iter()
                .enumerate()
                .filter(|(_, g)| **g == Gpu::Shared { free: WHOLE })
                .map(|(i, _)| i)
                .take(*count as usize)
                .collect();
            if idle.len() == *count as usize && *count > 0 {
                vec![choice(idle.into_iter().map(|g| (g, WHOLE)).collect(), None)]
            } else {
                Vec::new()
            }
        }
        GpuAsk::Mig(profile) => {
            let Some((model, p)) = crate::catalog::model(&node.model)
                .ok()
                .and_then(|m| Some((m, m.profile(profile)?)))
            else {
                return Vec::new();
            };
            let budget = model.mig.as_ref().map_or(0, |g| g.compute_slices);
            let mut out = Vec::new();
            for (g, gpu) in node.gpus.iter().enumerate() {
                let Gpu::Mig {
                    occupied,
                    compute_used,
                } = gpu
                else {
                    continue;
                };
                if compute_used + p.compute_slices > budget {
                    continue;
                }
                for &start in &p.placements {
                    let m = crate::mig::mask(gpuslice_api::Placement {
                        start,
                        size: p.memory_slices,
                    });
                    if m & occupied == 0 {
                        out.push(choice(Vec::new(), Some((g, start))));
                    }
                }
            }
            out
        }
    }
}

#[cfg(test)]
mod tests;
