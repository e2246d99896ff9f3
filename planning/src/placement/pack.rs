//! What a GPU's free share is worth to the shares the cluster expects, from the bin-packing LP.
//!
//! Packing the expected shares onto as few GPUs as possible is a cutting-stock problem
//! (Gilmore–Gomory): choose how many GPUs to fill with each *pattern* (a multiset of shares
//! that fits one GPU) so every share is covered. The dual of its LP relaxation prices each share
//! size in GPUs: no pattern is worth more than one GPU, and the patterns the best packing uses
//! are worth exactly one. The prices say what is scarce: a share that fills gaps of which there
//! are more than of such shares costs nothing (it rides beside a share that needs its own GPU
//! anyway), and sizes that compete for the same partners are priced by how well they pair.
//!
//! With those prices, `value(free)` is the most a GPU with `free` thousandths left can still
//! hold (a knapsack over the priced sizes). Placing a share costs the value it destroys beyond
//! its own price: zero when the share completes a pattern of the best packing, more when it
//! spoils a GPU that a dearer partner would have filled (a 320 beside a 470 where two 470s fit).

use microlp::{ComparisonOp, OptimizationDirection, Problem, Variable};

use super::WHOLE;

/// Prices of the expected share sizes and the value of every amount of free capacity.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShareValues {
    /// (size in thousandths, price in GPUs).
    prices: Vec<(u32, f64)>,
    /// `values[f]`: the most a GPU with `f` thousandths free can hold, in GPUs.
    values: Vec<f64>,
}

/// Stop adding patterns when none is worth more than a GPU by this much.
const EPS: f64 = 1e-7;
/// A bound on the cutting-plane rounds (each adds the most violated pattern).
const MAX_ROUNDS: usize = 200;

impl ShareValues {
    /// Prices for shares arriving in these proportions: (size in thousandths, count or weight).
    /// Sizes outside 1–999 and non-positive weights are ignored.
    pub fn learn(demand: &[(u32, f64)]) -> ShareValues {
        let demand: Vec<(u32, f64)> = demand
            .iter()
            .copied()
            .filter(|&(s, n)| (1..WHOLE).contains(&s) && n > 0.0)
            .collect();
        if demand.is_empty() {
            return ShareValues::default();
        }
        let sizes: Vec<u32> = demand.iter().map(|&(s, _)| s).collect();
        // The dual LP: maximise Σ demand·price subject to Σ price ≤ 1 over every pattern. Its
        // constraints are generated as needed: the pattern a knapsack finds most over-priced.
        let mut lp = Problem::new(OptimizationDirection::Maximize);
        let vars: Vec<Variable> = demand
            .iter()
            .map(|&(_, n)| lp.add_var(n, (0.0, 1.0)))
            .collect();
        for (v, &s) in vars.iter().zip(&sizes) {
            lp.add_constraint([(*v, f64::from(WHOLE / s))], ComparisonOp::Le, 1.0);
        }
        let mut prices: Vec<f64> = sizes.iter().map(|&s| 1.0 / f64::from(WHOLE / s)).collect();
        let mut solution = lp.solve().ok().and_then(|o| o.into_solution().ok());
        for _ in 0..MAX_ROUNDS {
            let Some(current) = solution.take() else {
                break;
            };
            prices = vars.iter().map(|v| current.var_value(*v)).collect();
            let (best, took) = knapsack(&sizes, &prices, WHOLE);
            if best[WHOLE as usize] <= 1.0 + EPS {
                break;
            }
            let row: Vec<(Variable, f64)> = vars
                .iter()
                .zip(&pattern(&sizes, &took, WHOLE))
                .filter(|(_, k)| **k > 0)
                .map(|(v, k)| (*v, f64::from(*k)))
                .collect();
            // Re-solved from the last basis: each round adds one row.
            solution = current
                .add_constraint(row, ComparisonOp::Le, 1.0)
                .ok()
                .and_then(|o| o.into_solution().ok());
        }
        let (mut values, _) = knapsack(&sizes, &prices, WHOLE);
        // Stopped before every pattern was priced within a GPU (many sizes, or the solver gave
        // up): scaled down, the prices are feasible again, only less sharp.
        let top = values[WHOLE as usize];
        if top > 1.0 + EPS {
            prices.iter_mut().for_each(|p| *p /= top);
            values.iter_mut().for_each(|v| *v /= top);
        }
        ShareValues {
            prices: sizes.into_iter().zip(prices).collect(),
            values,
        }
    }

    /// The most a GPU with `free` thousandths left can hold, in GPUs.
    pub fn value(&self, free: u32) -> f64 {
        self.values
            .get(free.min(WHOLE) as usize)
            .copied()
            .unwrap_or(0.0)
    }

    /// What placing a share of `size` on a GPU with `free` thousandths destroys beyond the
    /// share's own price, in GPUs (0 when it completes a pattern of the best packing).
    pub fn loss(&self, free: u32, size: u32) -> f64 {
        let price = self.price(size);
        (self.value(free) - self.value(free.saturating_sub(size)) - price).max(0.0)
    }

    /// A share size's price in GPUs (its value when it is not among the expected sizes).
    pub fn price(&self, size: u32) -> f64 {
        self.prices
            .iter()
            .find(|(s, _)| *s == size)
            .map_or_else(|| self.value(size), |(_, p)| *p)
    }
}

/// The most valuable multisets of `sizes` (unbounded, at their prices) within every capacity up
/// to `capacity`: the value at each capacity, and the size last taken there (to read a
/// pattern back).
fn knapsack(sizes: &[u32], prices: &[f64], capacity: u32) -> (Vec<f64>, Vec<Option<usize>>) {
    let cap = capacity as usize;
    let mut best = vec![0.0f64; cap + 1];
    let mut took: Vec<Option<usize>> = vec![None; cap + 1];
    for c in 1..=cap {
        best[c] = best[c - 1];
        for (i, (&s, &p)) in sizes.iter().zip(prices).enumerate() {
            let s = s as usize;
            if s <= c && best[c - s] + p > best[c] + 1e-12 {
                best[c] = best[c - s] + p;
                took[c] = Some(i);
            }
        }
    }
    (best, took)
}

/// The pattern the knapsack table holds at `capacity`: the count of each size.
fn pattern(sizes: &[u32], took: &[Option<usize>], capacity: u32) -> Vec<u32> {
    let mut counts = vec![0u32; sizes.len()];
    let mut c = capacity as usize;
    while c > 0 {
        match took[c] {
            Some(i) => {
                counts[i] += 1;
                c -= sizes[i] as usize;
            }
            None => c -= 1,
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_that_completes_the_best_pattern_costs_nothing() {
        // As many 650s as 320s: they pair (970); 470s pair with each other (940).
        let v = ShareValues::learn(&[(650, 100.0), (320, 100.0), (470, 100.0)]);
        assert!(v.loss(350, 320) < 1e-6, "320 beside a 650");
        assert!(v.loss(530, 470) < 1e-6, "470 beside a 470");
        // A 320 beside a 470 spoils a GPU that a second 470 would have filled.
        assert!(v.loss(530, 320) > 0.1, "{}", v.loss(530, 320));
        assert!((v.value(WHOLE) - 1.0).abs() < 1e-6);
    }

    #[test]
    fn a_share_outnumbered_by_its_partner_rides_free() {
        // Few 320s for many 650s: every 650 needs its own GPU anyway, so the 320 costs no GPU.
        let v = ShareValues::learn(&[(650, 100.0), (320, 10.0)]);
        assert!((v.price(650) - 1.0).abs() < 1e-6);
        assert!(v.price(320) < 1e-6);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn prices_are_a_feasible_dual_and_losses_are_never_negative(
                demand in prop::collection::vec((1u32..1000, 1u32..200), 1..12),
                free in 0u32..=1000,
                size in 1u32..1000,
            ) {
                let demand: Vec<(u32, f64)> =
                    demand.into_iter().map(|(s, n)| (s, f64::from(n))).collect();
                let v = ShareValues::learn(&demand);
                // No GPU can hold more than one GPU's worth, and more room is never worth less.
                prop_assert!(v.value(WHOLE) <= 1.0 + 1e-6, "{}", v.value(WHOLE));
                prop_assert!(v.value(free) <= v.value(free.saturating_add(10)) + 1e-12);
                prop_assert!(v.loss(free, size) >= 0.0);
                // The best packing uses some pattern worth a whole GPU.
                prop_assert!(v.value(WHOLE) >= 1.0 - 1e-6, "{}", v.value(WHOLE));
            }
        }
    }
}
