//! Device error counters recorded before and after a held run.
//!
//! Per-hardware-context error counts come from the device layer's query-only handle
//! ([`xdna::device::DeviceMonitor`]: `DRM_IOCTL_AMDXDNA_GET_ARRAY` `HW_CONTEXT_ALL`, or the legacy
//! `QUERY_HW_CONTEXTS`), which creates no heap or context of its own. When the device is absent or
//! the driver cannot report contexts, the counters are `None` ("unknown"); numbers are never invented.

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

/// Read the error counters of `device`: `None` when they cannot be read (device absent, not
/// amdxdna, query unsupported); the reason is logged at debug level.
pub fn read_error_counters(device: &Path) -> Option<Counters> {
    let monitor = match xdna::device::DeviceMonitor::open(device) {
        Ok(m) => m,
        Err(e) => {
            tracing::debug!("no error counters for {}: {e}", device.display());
            return None;
        }
    };
    match monitor.hw_contexts() {
        Ok(Some(entries)) => Some(Counters {
            per_context: entries.iter().map(|e| (e.context_id, e.errors)).collect(),
        }),
        Ok(None) => {
            tracing::debug!(
                "{}: the driver reports no hardware-context list; counters unknown",
                device.display()
            );
            None
        }
        Err(e) => {
            tracing::debug!("{}: {e}", device.display());
            None
        }
    }
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
