//! Placement policies: the baselines of the FGD paper, FGD itself, and ours.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};

use super::fragment::{Typical, after, expected, mix_of};
use super::pack::ShareValues;
use super::{Choice, Gpu, GpuAsk, Node, Policy, Request, WHOLE};

/// Any feasible node, uniformly.
pub struct Random {
    rng: StdRng,
}

impl Random {
    pub fn new(seed: u64) -> Random {
        Random {
            rng: StdRng::seed_from_u64(seed),
        }
    }
}

impl Policy for Random {
    fn name(&self) -> &str {
        "Random"
    }
    fn score(&mut self, _: &Node, _: &Request, _: &Choice) -> f64 {
        self.rng.random()
    }
    /// The largest of `copies` uniform draws, so every node (not every distinct state) is equally
    /// likely to win.
    fn score_copies(&mut self, _: &Node, _: &Request, _: &Choice, copies: usize) -> f64 {
        self.rng.random::<f64>().powf(1.0 / copies.max(1) as f64)
    }
    fn pick(&mut self, nodes: &BTreeSet<usize>) -> usize {
        let i = self.rng.random_range(0..nodes.len());
        *nodes.iter().nth(i).expect("index in range")
    }
}

fn shares(node: &Node, request: &Request) -> [(f64, f64); 3] {
    let gpus = (node.gpus.len().max(1) as f64) * f64::from(WHOLE);
    [
        (
            request.cpu_milli as f64 / node.cpu_total.max(1) as f64,
            node.cpu_free as f64 / node.cpu_total.max(1) as f64,
        ),
        (
            request.memory_mib as f64 / node.memory_total.max(1) as f64,
            node.memory_free as f64 / node.memory_total.max(1) as f64,
        ),
        (
            request.gpu_milli() as f64 / gpus,
            node.gpu_free() as f64 / gpus,
        ),
    ]
}

/// Tetris: the node whose free capacity lines up best with the request (largest dot product).
pub struct DotProd;

impl Policy for DotProd {
    fn name(&self) -> &str {
        "DotProd"
    }
    fn score(&mut self, node: &Node, request: &Request, _: &Choice) -> f64 {
        shares(node, request)
            .iter()
            .map(|(want, free)| want * free)
            .sum()
    }
}

/// Least capacity left on the node after the placement (CPU, memory and GPU shares summed).
pub struct BestFit;

fn left_after(node: &Node, request: &Request) -> f64 {
    shares(node, request)
        .iter()
        .map(|(want, free)| free - want)
        .sum()
}

impl Policy for BestFit {
    fn name(&self) -> &str {
        "BestFit"
    }
    fn score(&mut self, node: &Node, request: &Request, _: &Choice) -> f64 {
        -left_after(node, request)
    }
}

/// Fill GPUs already in use first, then idle GPUs of busy nodes, then idle nodes.
pub struct GpuPacking;

impl Policy for GpuPacking {
    fn name(&self) -> &str {
        "GpuPacking"
    }
    fn score(&mut self, node: &Node, request: &Request, choice: &Choice) -> f64 {
        let node_busy = node.gpus.iter().any(|g| g.free_milli() < WHOLE);
        let gpu_busy = choice
            .gpus
            .iter()
            .any(|&(g, _)| node.gpus[g].free_milli() < WHOLE);
        let tier = if gpu_busy {
            2.0
        } else if node_busy {
            1.0
        } else {
            0.0
        };
        let left: u32 = choice
            .gpus
            .iter()
            .map(|&(g, m)| node.gpus[g].free_milli() - m)
            .sum();
        tier * 1e6 - f64::from(left) - left_after(node, request) * 1e-3
    }
}

/// Fragmentation gradient descent: the placement that grows the expected fragment least, under a
/// task mix known in advance (the paper uses the trace's own).
pub struct Fgd {
    mix: Vec<Typical>,
    cache: HashMap<Node, f64>,
}

impl Fgd {
    pub fn new(mix: Vec<Typical>) -> Fgd {
        Fgd {
            mix,
            cache: HashMap::new(),
        }
    }
}

fn expected_cached(cache: &mut HashMap<Node, f64>, node: &Node, mix: &[Typical]) -> f64 {
    // Keyed by capacity only: names differ between otherwise identical nodes.
    let key = Node {
        name: String::new(),
        ..node.clone()
    };
    if let Some(v) = cache.get(&key) {
        return *v;
    }
    let v = expected(node, mix);
    cache.insert(key, v);
    v
}

fn growth(
    cache: &mut HashMap<Node, f64>,
    mix: &[Typical],
    node: &Node,
    request: &Request,
    choice: &Choice,
) -> f64 {
    let before = expected_cached(cache, node, mix);
    let next = after(node, request, choice);
    expected_cached(cache, &next, mix) - before
}

impl Policy for Fgd {
    fn name(&self) -> &str {
        "FGD"
    }
    fn score(&mut self, node: &Node, request: &Request, choice: &Choice) -> f64 {
        -growth(&mut self.cache, &self.mix, node, request, choice)
    }
}

/// Ours: fragmentation growth against the mix of *recent arrivals* (it needs no trace in
/// advance and follows a workload that drifts), plus the growth of the node's *CPU and memory
/// shortfall*: the idle GPU capacity that the node's free CPU or memory cannot feed at the rate
/// the expected GPU tasks bring them (CPU and memory per GPU thousandth, learned from the same
/// mix). Those GPUs are as lost as fragments, only later, so both count in GPU thousandths.
/// A share first of all goes where it *spoils the best packing* least: the shares of the mix
/// are priced by the dual of their bin-packing LP ([`ShareValues`]), and a share that leaves a
/// GPU worth less than what it took from it loses capacity for certain. A GPU-less task goes
/// where the fewest idle GPUs are at stake; among whole-GPU placements that cost the same, the
/// one that leaves the node fullest, so idle nodes stay whole for multi-GPU tasks.
///
/// Where some of the mix may only run on certain GPU models, capacity taken from those models
/// is charged for the constrained demand it displaces: each set of allowed models asks its share
/// of the GPU demand still to come (taken as the free capacity of the whole cluster) from the
/// free capacity of its own models, and a GPU thousandth of a model is priced at the pressure of
/// the sets that allow it (at most 1: then every one of them will be wanted by a constrained
/// task). Unconstrained work then leaves scarce models to the tasks that can run nowhere else.
pub struct Mix {
    window: VecDeque<Request>,
    capacity: usize,
    mix: Vec<Typical>,
    arrivals_since_refresh: usize,
    cache: HashMap<Node, f64>,
    /// CPU milli and memory MiB the expected GPU tasks bring per GPU thousandth.
    cpu_per_milli: f64,
    memory_per_milli: f64,
    /// What free share capacity is worth to the expected shares (re-learned with the mix).
    shares: ShareValues,
    /// Each set of allowed models in the mix and its share of the mix's GPU demand.
    constrained: Vec<(Vec<String>, f64)>,
    /// The displacement price of a GPU thousandth per model (from the last survey).
    model_price: HashMap<String, f64>,
}

impl Mix {
    /// Learns the mix from the last `window` arrivals.
    pub fn new(window: usize) -> Mix {
        Mix {
            window: VecDeque::with_capacity(window.min(1 << 16)),
            capacity: window.max(1),
            mix: Vec::new(),
            arrivals_since_refresh: 0,
            cache: HashMap::new(),
            cpu_per_milli: 0.0,
            memory_per_milli: 0.0,
            shares: ShareValues::default(),
            constrained: Vec::new(),
            model_price: HashMap::new(),
        }
    }

    fn refresh(&mut self) {
        self.mix = mix_of(self.window.iter());
        let gpu: f64 = self
            .mix
            .iter()
            .map(|t| t.weight * t.request.gpu_milli() as f64)
            .sum();
        if gpu > 0.0 {
            let per_milli = |of: fn(&Request) -> u64| {
                self.mix
                    .iter()
                    .map(|t| t.weight * of(&t.request) as f64)
                    .sum::<f64>()
                    / gpu
            };
            self.cpu_per_milli = per_milli(|r| r.cpu_milli);
            self.memory_per_milli = per_milli(|r| r.memory_mib);
        }
        let mut demand: BTreeMap<u32, f64> = BTreeMap::new();
        for t in &self.mix {
            if let GpuAsk::Share(m) = t.request.gpu {
                *demand.entry(m).or_default() += t.weight;
            }
        }
        self.shares = ShareValues::learn(&demand.into_iter().collect::<Vec<_>>());
        let mut by_models: BTreeMap<Vec<String>, f64> = BTreeMap::new();
        for t in self.mix.iter().filter(|t| !t.request.models.is_empty()) {
            let mut models = t.request.models.clone();
            models.sort();
            *by_models.entry(models).or_default() += t.weight * t.request.gpu_milli() as f64;
        }
        self.constrained = by_models
            .into_iter()
            .map(|(models, d)| (models, if gpu > 0.0 { d / gpu } else { 0.0 }))
            .collect();
        self.cache.clear();
        self.arrivals_since_refresh = 0;
    }
}

impl Mix {
    /// Constrained demand that taking `milli` from a `model` GPU displaces: in millionths of a
    /// GPU when the model's capacity is all wanted (certain, like a packing loss), else its
    /// expectation in thousandths (like a fragment).
    fn displaced(&self, model: &str, milli: u64) -> f64 {
        match self.model_price.get(model).copied().unwrap_or(0.0) {
            price if price >= 1.0 => milli as f64 * 1e3,
            price => price * milli as f64,
        }
    }

    /// Idle GPU thousandths on `node` beyond what its free CPU and memory can feed at the rates
    /// the expected GPU tasks need them.
    fn shortfall(&self, node: &Node) -> f64 {
        let idle: f64 = node
            .gpus
            .iter()
            .map(|g| match g {
                Gpu::Shared { free } => f64::from(*free),
                Gpu::Mig { .. } => 0.0,
            })
            .sum();
        let fed = |free: u64, per_milli: f64| {
            if per_milli > 0.0 {
                free as f64 / per_milli
            } else {
                f64::INFINITY
            }
        };
        let feedable = fed(node.cpu_free, self.cpu_per_milli)
            .min(fed(node.memory_free, self.memory_per_milli));
        (idle - feedable).max(0.0)
    }
}

impl Default for Mix {
    fn default() -> Mix {
        Mix::new(2000)
    }
}

/// How many arrivals between re-learning the mix (scores are cached between refreshes).
const REFRESH_EVERY: usize = 200;

impl Policy for Mix {
    fn name(&self) -> &str {
        "gpuslice"
    }

    fn observe(&mut self, request: &Request) {
        if self.window.len() == self.capacity {
            self.window.pop_front();
        }
        self.window.push_back(request.clone());
        self.arrivals_since_refresh += 1;
        // Learn quickly at first (each time the window has doubled), then every so often.
        if self.mix.is_empty()
            || self.arrivals_since_refresh >= REFRESH_EVERY.min(self.window.len().div_ceil(2))
        {
            self.refresh();
        }
    }

    fn survey(&mut self, free_by_model: &BTreeMap<String, u64>) {
        self.model_price.clear();
        let total: u64 = free_by_model.values().sum();
        for (models, share) in &self.constrained {
            let supply: u64 = models.iter().filter_map(|m| free_by_model.get(m)).sum();
            let pressure = share * total as f64 / supply.max(1) as f64;
            for m in models {
                let price = self.model_price.entry(m.clone()).or_default();
                *price = (*price + pressure).min(1.0);
            }
        }
    }

    fn score(&mut self, node: &Node, request: &Request, choice: &Choice) -> f64 {
        let mix = std::mem::take(&mut self.mix);
        let grow = if mix.is_empty() {
            0.0
        } else {
            growth(&mut self.cache, &mix, node, request, choice)
        };
        self.mix = mix;
        let next = after(node, request, choice);
        let shortfall_growth = self.shortfall(&next) - self.shortfall(node);
        // The last CPU or memory of a node with idle GPUs: those GPUs are lost for certain.
        let exhausted = if next
            .gpus
            .iter()
            .any(|g| matches!(g, Gpu::Shared { free } if *free > 0))
            && (next.cpu_free == 0 || next.memory_free == 0)
        {
            next.gpu_free() as f64
        } else {
            0.0
        };
        // A share's packing loss is certain: capacity no expected share can use any more. The
        // fragment growth is an expectation that later arrivals often undo. So the loss decides
        // (in millionths of a GPU, rounded so that the LP's round-off cannot break a tie) and the
        // fragment breaks ties; measured, any weight from 16x the fragment's unit up gives the
        // same placements.
        let packing = match (&request.gpu, choice.gpus.first()) {
            (GpuAsk::Share(m), Some(&(g, _))) => {
                (self.shares.loss(node.gpus[g].free_milli(), *m) * 1e6).round()
            }
            _ => 0.0,
        };
        let nudge = match request.gpu {
            // Among equally fragmenting shares the fragment measure already chose the GPU; a fill
            // preference here only packs shares onto nodes that whole-GPU tasks need.
            GpuAsk::Share(_) => 0.0,
            // A GPU-less task uses CPU and memory that the idle GPUs of its node will need: it
            // goes where the fewest idle GPUs are at stake.
            GpuAsk::None => node.gpu_free() as f64 * 0.1,
            _ => left_after(node, request) * 1e-3,
        };
        // Constrained demand displaced is as certain as a packing loss once a model's capacity
        // is all wanted: then it counts in the same unit (millionths of a GPU); before that it is
        // an expectation, like the fragment's, in thousandths.
        let displaced = self.displaced(&node.model, request.gpu_milli());
        -(grow + shortfall_growth + exhausted + packing + displaced) - nudge
    }
}

/// Every policy of the comparison, ours last.
pub fn all(seed: u64, trace_mix: Vec<Typical>) -> Vec<Box<dyn Policy>> {
    vec![
        Box::new(Random::new(seed)),
        Box::new(DotProd),
        Box::new(GpuPacking),
        Box::new(BestFit),
        Box::new(Fgd::new(trace_mix)),
        Box::new(Mix::default()),
    ]
}
