//! Device error counters recorded before and after a held run.
//!
//! The device layer (branch `device`) will provide per-hardware-context error counts from
//! `DRM_IOCTL_AMDXDNA_GET_ARRAY` / `HW_CONTEXT_ALL`. Until it lands, [`read_error_counters`] reports
//! `None` ("unknown") for every device; it never invents numbers.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

/// Error counts of one device, keyed by hardware context id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Counters {
    pub per_context: BTreeMap<u32, u64>,
}

impl Counters {
    pub fn total(&self) -> u64 {
        self.per_context
            .values()
            .fold(0u64, |a, b| a.saturating_add(*b))
    }

    /// Keep, per context, the highest count seen in `self` or `other` (counts only grow while a
    /// context lives; contexts that appeared during the run are kept after they are gone).
    pub fn merge_max(&mut self, other: &Counters) {
        for (ctx, &n) in &other.per_context {
            let e = self.per_context.entry(*ctx).or_insert(n);
            *e = (*e).max(n);
        }
    }
}

/// Where error counters come from. The device layer implements this once GET_ARRAY HW_CONTEXT_ALL
/// is available; [`PendingDeviceLayer`] is the placeholder used until then.
pub trait ErrorCounterSource {
    /// `None` when the counters cannot be read (device absent, query unsupported, ...).
    fn read_error_counters(&self, device: &Path) -> Option<Counters>;
}

/// Placeholder source: knows whether the device node exists, cannot query it yet.
pub struct PendingDeviceLayer;

impl ErrorCounterSource for PendingDeviceLayer {
    fn read_error_counters(&self, device: &Path) -> Option<Counters> {
        if !device.exists() {
            tracing::debug!(
                "device {} absent: no error counters recorded",
                device.display()
            );
            return None;
        }
        // TODO(device layer): once branch `device` is merged, this is
        //   XdnaDevice::open(device)?.hw_contexts()? -> Vec<HwContextEntry>
        //   mapped to per_context[e.context_id] = e.errors
        // (runtime/device/xdna.rs: GET_ARRAY HW_CONTEXT_ALL, legacy QUERY_HW_CONTEXTS fallback).
        tracing::debug!(
            "device {}: error counter query (GET_ARRAY HW_CONTEXT_ALL) not wired yet; counters unknown",
            device.display()
        );
        None
    }
}

/// Read the error counters of `device` with the current source.
pub fn read_error_counters(device: &Path) -> Option<Counters> {
    PendingDeviceLayer.read_error_counters(device)
}

/// Human-readable lines for every change between `before` and `after` (empty when unchanged).
pub fn describe_change(before: &Counters, after: &Counters) -> Vec<String> {
    let mut lines = Vec::new();
    for (ctx, &new) in &after.per_context {
        let old = before.per_context.get(ctx).copied();
        match old {
            Some(old) if old == new => {}
            Some(old) => lines.push(format!("context {ctx}: errors {old} -> {new}")),
            None if new > 0 => lines.push(format!("context {ctx} (new): {new} errors")),
            None => {}
        }
    }
    for (ctx, old) in &before.per_context {
        if !after.per_context.contains_key(ctx) && *old > 0 {
            lines.push(format!("context {ctx}: gone (had {old} errors)"));
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(pairs: &[(u32, u64)]) -> Counters {
        Counters {
            per_context: pairs.iter().copied().collect(),
        }
    }

    #[test]
    fn unchanged_counters_report_nothing() {
        assert!(describe_change(&c(&[(1, 2)]), &c(&[(1, 2)])).is_empty());
        assert!(describe_change(&c(&[]), &c(&[(3, 0)])).is_empty());
    }

    #[test]
    fn changes_are_reported() {
        let lines = describe_change(&c(&[(1, 2), (2, 1)]), &c(&[(1, 5), (7, 1)]));
        assert_eq!(
            lines,
            vec![
                "context 1: errors 2 -> 5".to_string(),
                "context 7 (new): 1 errors".to_string(),
                "context 2: gone (had 1 errors)".to_string(),
            ]
        );
        assert_eq!(c(&[(1, 5), (7, 1)]).total(), 6);
    }

    #[test]
    fn merging_keeps_contexts_that_came_and_went() {
        let mut seen = c(&[(1, 2)]);
        seen.merge_max(&c(&[(1, 3), (9, 1)])); // during the run: context 9 of the command
        seen.merge_max(&c(&[(1, 3)])); // after: context 9 destroyed with its process
        assert_eq!(seen, c(&[(1, 3), (9, 1)]));
        assert_eq!(
            describe_change(&c(&[(1, 2)]), &seen),
            vec![
                "context 1: errors 2 -> 3".to_string(),
                "context 9 (new): 1 errors".to_string()
            ]
        );
    }

    #[test]
    fn absent_device_has_no_counters() {
        assert_eq!(
            read_error_counters(Path::new("/nonexistent/accel/accel9")),
            None
        );
    }
}
