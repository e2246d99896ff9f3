//! What the agent does about an XID error when the GPU's pool has `faultIsolation` enabled
//! (codes and meanings from NVIDIA's XID catalogue). Errors an application causes in its own
//! context quarantine only its slice; errors of the GPU itself (memory it cannot correct, the bus,
//! NVLink, the GPU's firmware) drain the whole GPU and keep it out of service until it is reset.
//! Anything else is counted and logged only.

/// What an XID leads to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XidAction {
    /// Counted and logged; no slice is touched.
    Count,
    /// The slice whose workload caused it takes no new work until that workload releases it.
    QuarantineSlice,
    /// Every workload on the GPU is drained (its CheckpointPolicy) and the GPU takes no new work
    /// until it is reset.
    DrainGpu,
}

impl XidAction {
    /// As metrics and logs name it.
    pub fn as_str(self) -> &'static str {
        match self {
            XidAction::Count => "count",
            XidAction::QuarantineSlice => "quarantine-slice",
            XidAction::DrainGpu => "drain-gpu",
        }
    }
}

/// One row of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XidRule {
    pub code: u64,
    /// NVIDIA's name for it.
    pub meaning: &'static str,
    pub action: XidAction,
}

const fn rule(code: u64, meaning: &'static str, action: XidAction) -> XidRule {
    XidRule {
        code,
        meaning,
        action,
    }
}

/// The table (`docs/node-protections.md` shows it).
pub const TABLE: &[XidRule] = &[
    rule(13, "graphics engine exception", XidAction::QuarantineSlice),
    rule(31, "GPU memory page fault", XidAction::QuarantineSlice),
    rule(43, "GPU stopped processing", XidAction::QuarantineSlice),
    rule(
        45,
        "preemptive cleanup after an earlier error",
        XidAction::Count,
    ),
    rule(48, "double-bit ECC error", XidAction::DrainGpu),
    rule(62, "internal micro-controller halt", XidAction::DrainGpu),
    rule(
        63,
        "ECC page retirement or row remapping recorded",
        XidAction::Count,
    ),
    rule(
        64,
        "ECC page retirement or row remapping failed",
        XidAction::DrainGpu,
    ),
    rule(68, "video decoder exception", XidAction::QuarantineSlice),
    rule(
        69,
        "graphics engine class error",
        XidAction::QuarantineSlice,
    ),
    rule(74, "NVLink error", XidAction::DrainGpu),
    rule(79, "GPU has fallen off the bus", XidAction::DrainGpu),
    rule(92, "high single-bit ECC error rate", XidAction::Count),
    rule(94, "contained ECC error", XidAction::QuarantineSlice),
    rule(95, "uncontained ECC error", XidAction::DrainGpu),
    rule(109, "context switch timeout", XidAction::QuarantineSlice),
    rule(119, "GSP RPC timeout", XidAction::DrainGpu),
    rule(120, "GSP error", XidAction::DrainGpu),
];

/// The rule for `code`; a code not in the table is counted only.
pub fn rule_for(code: u64) -> XidRule {
    TABLE
        .iter()
        .find(|r| r.code == code)
        .copied()
        .unwrap_or(rule(code, "not in gpuslice's XID table", XidAction::Count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_sorted_without_repeats_and_unknown_codes_are_only_counted() {
        assert!(TABLE.windows(2).all(|w| w[0].code < w[1].code));
        assert_eq!(rule_for(79).action, XidAction::DrainGpu);
        assert_eq!(rule_for(31).action, XidAction::QuarantineSlice);
        assert_eq!(rule_for(45).action, XidAction::Count);
        assert_eq!(rule_for(12345).action, XidAction::Count);
        assert_eq!(rule_for(12345).meaning, "not in gpuslice's XID table");
    }
}
